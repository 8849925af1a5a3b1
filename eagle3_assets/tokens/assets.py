"""``token_ids``: token-exact training sequences with loss masks and agreement figures.

Only the final (generated) assistant turn is supervised: the loss mask covers the completion,
never the prompt, whatever turns the prompt holds. ``built_from`` says where each completion came
from (``native``: the backend's ids; ``retokenized``: rebuilt from text and reasoning), and
``build_notes`` how (see ``eagle3_assets.tokens.rows``).
"""


import dagster as dg
import polars as pl

from eagle3_assets.generation.assets import raw_responses
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.prompts.table import read_prompt_table
from eagle3_assets.resources import StorageResource, TargetResource
from eagle3_assets.tokens.digest import RESPONSE_DIGEST_COLUMN, response_digest
from eagle3_assets.tokens.rows import build_token_row
from eagle3_assets.tokens.table import agreement_summary, write_token_table


class TokenIdsConfig(dg.Config):
    """``max_length``: longest training sequence; 0 means the model's context (``config.json``
    ``max_position_embeddings``) when known, else no limit. A longer sequence fails the step with
    the sample id and its lengths unless ``truncate``, which cuts the completion at the limit."""

    max_length: int = 0
    truncate: bool = False


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[raw_responses],
    group_name="tokens",
    kinds={"parquet"},
    description="Prompt ids + output ids per sample, loss mask on assistant tokens, re-tokenization agreement.",
)
def token_ids(context: dg.AssetExecutionContext, config: TokenIdsConfig, storage: StorageResource,
              target: TargetResource) -> dg.MaterializeResult:
    dataset = context.partition_key
    layout = storage.layout
    tok = target.load_tokenizer()
    prompts = {p.prompt_id: p for p in read_prompt_table(layout.prompt_table(dataset))}
    max_length = config.max_length or None  # None: the model's context
    rows = []
    for r, line in ResponseStore(layout.responses_dir(dataset)).iter_rows_with_lines():
        p = prompts.get(r["prompt_id"])
        rows.append({**build_token_row(r, p.messages if p else None, tok, tools=p.tools if p else None,
                                       max_length=max_length, truncate=config.truncate),
                     RESPONSE_DIGEST_COLUMN: response_digest(line)})  # a reply edited later shows this row stale
    out = layout.tokens(dataset)
    frame = write_token_table(rows, out)
    agree = agreement_summary(frame)
    diffs = frame.filter(pl.col("retok_diff") != "").head(5).select("sample_id", "source", "retok_diff").to_dicts()
    by_source = frame.group_by("source", "built_from").len().sort("source").to_dicts()
    context.log.info(f"{dataset}: {frame.height} token rows; agreement {agree['token_agreement']}")
    return dg.MaterializeResult(
        metadata={
            "rows": frame.height,
            "tokens": int(frame["input_ids"].list.len().sum() or 0),
            "loss_tokens": int(frame["completion_len"].sum() or 0),
            "native_rows": int(frame["native_ids"].sum() or 0),
            "retokenized_rows": int((~frame["native_ids"]).sum() or 0),
            "token_agreement": agree["token_agreement"],
            "exact_sequence_rate": agree["exact_sequence_rate"],
            "tool_call_rows": int((frame["tool_calls"] > 0).sum() or 0),
            "tool_call_rows_with_native_ids": agree["tool_call_rows_with_native_ids"],
            "tool_call_token_agreement": agree["tool_call_token_agreement"],
            "tool_call_exact_rate": agree["tool_call_exact_rate"],
            "by_source": md_table(by_source),
            "retokenization_diffs": md_table(diffs),
            "end_of_turn": f"{tok.end_of_turn} = {tok.end_of_turn_id}",
            "thinking": str(tok.thinking),
            "max_length": max_length or tok.context_length or 0,
            "truncated_rows": int(frame["build_notes"].str.contains("truncated").sum() or 0) if frame.height else 0,
            "path": dg.MetadataValue.path(str(out)),
        }
    )
