"""Stands for sgl_kernel's compiled CUDA library (``common_ops.abi3.so``): it registers no op.

sgl_kernel imports ``common_ops`` as its last resort when no compiled library is found; this empty
module lets its Python import on a CPU, where SGLang uses native torch ops instead.
"""
