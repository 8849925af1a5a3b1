"""The target's tokenizer: chat template, ids and the end-of-turn token."""



import dagster as dg

from .local_model import EmbeddedModelResource


class TokenizerResource(dg.ConfigurableResource):
    """Empty ``path`` means the embedded model's tokenizer. ``end_of_turn`` is the string that
    ends an assistant turn (``<|im_end|>`` for ChatML and Kimi); empty means the tokenizer's
    ``eos_token``. Its id is always looked up, never hard-coded. ``thinking``: None leaves the chat
    template's default; true/false is passed to the template as the ``thinking`` kwarg (Kimi K2.5:
    generation prompt ``<think>`` vs ``<think></think>``) and must match what the server used.
    A Kimi checkpoint needs ``trust_remote_code: true`` (its tokenizer is ``tokenization_kimi.py``)."""

    model: EmbeddedModelResource
    path: str = ""
    end_of_turn: str = ""
    trust_remote_code: bool = False
    thinking: bool | None = None

    def load(self):
        from eagle3_assets.tokens.tokenizer import TargetTokenizer

        path = self.path or str(self.model.resolved_dir())
        return TargetTokenizer.load(path, end_of_turn=self.end_of_turn, trust_remote_code=self.trust_remote_code,
                                    thinking=self.thinking)
