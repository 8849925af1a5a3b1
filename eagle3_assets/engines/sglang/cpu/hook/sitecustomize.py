"""Declare torchvision's ``nms`` and ``qnms`` op schemas before torchvision imports (no kernels).

PyPI's torchvision is a CUDA build whose extension does not load next to the CPU torch; its Python
then registers fake kernels for ops that were never defined and the import fails. SGLang imports
torchvision's transforms indirectly and never runs these ops.
"""

try:
    import torch

    _TORCHVISION = torch.library.Library("torchvision", "FRAGMENT")
    for _schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
        try:
            _TORCHVISION.define(_schema)
        except RuntimeError:  # already defined (a working torchvision build loaded first)
            pass
except ImportError:  # an environment without torch: nothing to declare
    pass

try:
    import cuda_sync_on_cpu  # noqa: F401  (torch.cuda.synchronize() on a torch without CUDA)
    import sgl_kernel_attention_ops  # noqa: F401  (intel_amx backend's decode/extend attention)
    import sgl_kernel_cpu_ops  # noqa: F401  (the CPU ops SGLang's CPU engine calls)
    import sgl_kernel_spec_ops  # noqa: F401  (the EAGLE worker's tree and cache-location ops)
except ImportError:  # no torch here
    pass
