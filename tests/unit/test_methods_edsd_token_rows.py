"""EDSD's token rows (methods/edsd/token_rows.py): a table over the draft vocabulary of what a
draft forward computes from its input token alone. Its rows are the matmuls' results, a forward
with a token outside the draft vocabulary gets none, and q/k/v's feature half is read back
exactly through the projection itself. The served path is checked against the reference model in
real engines (tests/engine/test_serving_engines.py, the parity tests)."""

from __future__ import annotations

import torch

import vllm_edsd.methods.edsd.token_rows as token_rows

TARGET_VOCAB, WIDTH = 50, 8


def projections():
    torch.manual_seed(0)
    embedding = torch.randn(TARGET_VOCAB, WIDTH)
    up, qkv = torch.randn(6, WIDTH), torch.randn(12, 2 * WIDTH)
    return embedding, up, qkv


def test_rows_are_the_matmuls_of_the_draft_vocabulary():
    embedding, up, qkv = projections()
    draft_to_target = torch.tensor([0, 2, 2, 5, 40])  # d2t's offsets: target ids 0, 3, 4, 8, 44
    target_ids = torch.arange(5) + draft_to_target
    rows = token_rows.build(target_ids, TARGET_VOCAB, lambda ids: embedding[ids],
                            lambda e: e @ up.T, lambda e: e @ qkv[:, WIDTH:].T)
    assert rows.slot_of_target[target_ids].tolist() == [0, 1, 2, 3, 4]
    assert (rows.slot_of_target >= 0).sum() == 5
    inputs = torch.tensor([44, 3, 3, 0], dtype=torch.int32)  # the proposer hands int32 ids
    up_rows, qkv_rows = rows.rows_of(inputs)
    torch.testing.assert_close(up_rows, embedding[inputs.long()] @ up.T)
    torch.testing.assert_close(qkv_rows.rows, embedding[inputs.long()] @ qkv[:, WIDTH:].T)
    assert rows.nbytes == TARGET_VOCAB * 8 + 5 * (6 + 12) * 4


def test_a_token_outside_the_draft_vocabulary_takes_the_matmuls():
    embedding, up, _ = projections()
    rows = token_rows.build(torch.tensor([1, 2, 3]), TARGET_VOCAB, lambda ids: embedding[ids], lambda e: e @ up.T,
                            None)
    assert rows.qkv is None and rows.rows_of(torch.tensor([3, 1]))[1].rows is None
    assert rows.rows_of(torch.tensor([3, 4])) is None


def test_rows_are_built_in_chunks_in_draft_order():
    embedding = torch.randn(3000, WIDTH)
    target_ids = torch.arange(0, 3000, 2)  # 1,500 draft tokens: two chunks
    rows = token_rows.build(target_ids, 3000, lambda ids: embedding[ids], lambda e: e * 2, None)
    torch.testing.assert_close(rows.up, embedding[target_ids] * 2)


def test_feature_half_is_read_back_exactly_through_the_projection():
    _, _, qkv = projections()
    weight = token_rows.feature_half(lambda x: (x @ qkv.T, None), WIDTH, torch.float32, "cpu")
    assert torch.equal(weight, qkv[:, :WIDTH])


def test_table_bytes_count_the_dtype():
    assert token_rows.table_bytes(4096, 1536, torch.float32) == 4096 * 1536 * 4
    assert token_rows.table_bytes(4096, 1536, torch.bfloat16) == 4096 * 1536 * 2
