"""Forward/backward of every model on a TorchRec Batch: shapes, finite loss, gradients reach every part."""

from __future__ import annotations

import pytest
import torch

from herald_torchrec.data.batch import to_batch
from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec
from herald_torchrec.models import MODELS, FeatureSpec, TrainModel, build_model

GEN = SyntheticCTR(SyntheticSpec(scale=0.001, num_tables=6, num_dense=4))
SPEC = FeatureSpec(tuple(GEN.feature_names), tuple(GEN.table_rows), GEN.num_dense)


def _batch(spec: FeatureSpec, n: int = 64):
    s = GEN.global_batch(3, n)
    return to_batch(s, [GEN.feature_names.index(f) for f in spec.names], list(spec.names))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_backward(name: str) -> None:
    torch.manual_seed(0)
    spec = SPEC.subset(["c2", "c3"]) if name == "ncf" else SPEC
    model = TrainModel(build_model(name, spec, embedding_dim=8))
    batch = _batch(spec)
    loss, (loss_d, logits, labels) = model(batch)
    assert logits.shape == (64,) and labels.shape == (64,)
    assert torch.isfinite(loss) and 0.0 < float(loss) < 10.0
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient reached {pname}"
    emb = model.model.ebc.embedding_bags[f"t_{spec.names[0]}"].weight
    ids = batch.sparse_features[spec.names[0]].values()
    assert emb.grad[ids].abs().sum() > 0, "looked-up rows must get gradient"
    untouched = torch.ones(emb.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert emb.grad[untouched].abs().sum() == 0, "rows not looked up must get no gradient"


def test_embedding_dim_must_suit_fbgemm() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        build_model("dcn", SPEC, embedding_dim=6)


@pytest.mark.parametrize("name", ["wdl", "deepfm"])
def test_wide_column_is_a_linear_term(name: str) -> None:
    """The extra embedding column is the per-id wide / first-order weight: it shifts the logit additively."""
    torch.manual_seed(0)
    model = build_model(name, SPEC, embedding_dim=8)
    batch = _batch(SPEC, 16)
    base = model(batch.dense_features, batch.sparse_features)
    with torch.no_grad():
        model.ebc.embedding_bags["t_c0"].weight[:, 7] += 0.5
    moved = model(batch.dense_features, batch.sparse_features)
    assert torch.allclose(moved - base, torch.full_like(base, 0.5), atol=1e-5)


def test_unknown_model_and_bad_features() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        build_model("nope", SPEC)
    with pytest.raises(ValueError, match="user and an item"):
        build_model("ncf", SPEC)
    with pytest.raises(ValueError, match="not in the data"):
        SPEC.subset(["user"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_read_the_embeddings_by_feature_not_by_key_order(name: str) -> None:
    """A sharded EBC's KeyedTensor lists its keys in the sharding's order (TorchRec TABLE_WISE groups them by rank):
    every model reads its embeddings by feature name, so the same embeddings in another key order give the same
    logits (DCN fed `values()` to its layers: under stock TABLE_WISE it trained another model than on one rank)."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    torch.manual_seed(0)
    spec = SPEC.subset(["c2", "c3"]) if name == "ncf" else SPEC
    model = build_model(name, spec, embedding_dim=8)
    batch = _batch(spec)
    emb = model.ebc(batch.sparse_features)
    d = emb.to_dict()
    keys = list(reversed(emb.keys()))
    shuffled = KeyedTensor.from_tensor_list(keys, [d[k] for k in keys])
    assert keys != emb.keys()
    want = model.logits(batch.dense_features, emb)
    assert torch.equal(model.logits(batch.dense_features, shuffled), want)
