"""kimi-mini's multimodal processor, shipped as remote code under the class name Kimi-K2.5's
``preprocessor_config.json`` names (``kimi_k25_processor.KimiK25Processor``): the tokenizer plus
the image processor, with each ``<|media_pad|>`` in the text widened to the image's token count."""

from __future__ import annotations

from transformers.feature_extraction_utils import BatchFeature

MEDIA_PAD = "<|media_pad|>"


class KimiK25Processor:
    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        # K2.5's processor also holds its image processor as ``media_processor``; SGLang's K2.5
        # processor reads ``media_processor.media_proc_cfg`` when its server starts
        self.media_processor = image_processor

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """transformers' AutoProcessor calls this on remote-code classes; nothing to record."""

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        from transformers import AutoImageProcessor, AutoTokenizer

        keep = {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "revision", "local_files_only")}
        keep["trust_remote_code"] = True  # both halves are remote code in a K2.5 checkpoint
        return cls(image_processor=AutoImageProcessor.from_pretrained(path, **keep),
                   tokenizer=AutoTokenizer.from_pretrained(path, **keep))

    def __call__(self, text: str | None = None, medias: list | None = None, return_tensors=None, **kwargs):
        data = {}
        if medias:
            images = self.image_processor.preprocess(medias)
            counts = [self.image_processor.media_tokens_calculator(m if isinstance(m, dict) else {"image": m})
                      for m in medias]
            pieces = (text or "").split(MEDIA_PAD)
            if len(pieces) - 1 != len(counts):
                raise ValueError(f"{len(counts)} images for {len(pieces) - 1} {MEDIA_PAD} placeholders")
            text = pieces[0] + "".join(MEDIA_PAD * n + rest for n, rest in zip(counts, pieces[1:]))
            data.update(images.data)
        if text is not None:
            data.update(self.tokenizer(text, **kwargs))
        return BatchFeature(data=data, tensor_type=return_tensors)
