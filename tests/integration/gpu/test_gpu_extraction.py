"""On a CUDA GPU: ``auto`` loads the target in bf16 on the GPU, and the pipelined extraction (pinned
buffers, asynchronous copies) stores exactly the states of a bare ``output_hidden_states`` forward."""

import polars as pl
import pytest
import torch

from eagle3_assets.engines.local.extractor import LocalExtractor
from eagle3_assets.hidden_states.extract import extract_corpus, plan_batches, verify_shards
from eagle3_assets.hidden_states.reader import ShardReader
from eagle3_assets.target.precision import resolve_device, resolve_dtype
from tests.unit.hidden_states.test_hidden_states import LENGTHS, TWO_SAMPLES, make_corpus

pytestmark = [pytest.mark.gpu, pytest.mark.model]


def test_cuda_bf16_extraction_equals_a_bare_forward(model_dir, tmp_path):
    assert (resolve_device("auto"), resolve_dtype("auto")) == ("cuda", "bfloat16")
    extractor = LocalExtractor(model_dir, device="auto", dtype="auto")
    assert extractor.device.type == "cuda" and {p.dtype for p in extractor.model.parameters()} == {torch.bfloat16}
    corpus = make_corpus(tmp_path / "corpus.parquet")
    out = tmp_path / "hs"
    report = extract_corpus(corpus, out, extractor, shard_bytes=TWO_SAMPLES, batch_tokens=4096)
    assert report.extracted == 6 and verify_shards(out, corpus).ok
    frame = pl.read_parquet(corpus)
    (order,) = plan_batches(LENGTHS, 4096)  # the one batch, in the order the extraction ran it
    rows = [frame["input_ids"][i].to_list() for i in order]
    width = max(LENGTHS)
    ids = torch.full((len(rows), width), extractor.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, : len(row)] = torch.tensor(row)
        mask[k, : len(row)] = 1
    with torch.inference_mode():
        hs = extractor.model(input_ids=ids.cuda(), attention_mask=mask.cuda(), output_hidden_states=True,
                             use_cache=False).hidden_states
    index = [j + 1 for j in extractor.layer_ids]
    reader = ShardReader(out)
    for k, i in enumerate(order):
        s, n = reader.read(frame["sample_id"][i]), LENGTHS[i]
        assert torch.equal(s.aux_hidden, torch.cat([hs[j][k, :n] for j in index], -1).cpu())
        assert torch.equal(s.last_hidden, hs[-1][k, :n].cpu())
