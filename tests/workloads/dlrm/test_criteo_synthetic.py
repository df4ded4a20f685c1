"""The synthetic Criteo generator: schema, determinism, power-law ids, a planted signal a model can learn."""

import numpy as np
import pytest
from scipy import sparse
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss, roc_auc_score
from sklearn.preprocessing import OneHotEncoder

from comera.metrics import binary_entropy
from comera.workloads.dlrm import synthetic as synthetic_module
from comera.workloads.dlrm.criteo import KAGGLE_CARDINALITIES
from comera.workloads.dlrm.synthetic import synthetic_criteo


def test_schema_and_capped_cardinalities():
    log = synthetic_criteo(3000, seed=1, max_table_rows=500)
    assert log.cardinalities == tuple(min(n, 500) for n in KAGGLE_CARDINALITIES)
    assert log.data.dense.shape == (3000, 13) and log.data.dense.dtype == np.float32
    assert log.data.ids.shape == (3000, 26)
    assert np.all(log.data.ids >= 0) and np.all(log.data.ids < np.array(log.cardinalities))
    assert set(np.unique(log.data.labels)) == {0, 1}
    assert np.all(log.data.dense >= 0)
    assert (log.data.dense == 0).mean() > 0.1  # missing and clamped counts read as log(1 + 0)


def test_same_seed_same_data_and_rows_independent_of_count():
    first, again = (
        synthetic_criteo(2000, seed=4, max_table_rows=300),
        synthetic_criteo(2000, seed=4, max_table_rows=300),
    )
    for name in ("dense", "ids", "labels"):
        np.testing.assert_array_equal(getattr(first.data, name), getattr(again.data, name))
    longer = synthetic_criteo(20_000, seed=4, max_table_rows=300)
    np.testing.assert_array_equal(longer.data.ids[:2000], first.data.ids)
    # the logits of a block are matrix products over its rows: 8192 rows here, 2000 above; a BLAS may round
    # the same row differently in products of other sizes, so the float32 logits agree to rounding only
    np.testing.assert_allclose(longer.logits[:2000], first.logits, rtol=1e-6, atol=1e-6)
    other = synthetic_criteo(2000, seed=5, max_table_rows=300)
    assert not np.array_equal(other.data.ids, first.data.ids)


def test_cached_log_equals_the_generated_one_and_is_reused(tmp_path, monkeypatch):
    first = synthetic_criteo(9000, seed=6, max_table_rows=200, cache_dir=tmp_path)
    memory = synthetic_criteo(9000, seed=6, max_table_rows=200)
    for name in ("dense", "ids", "labels"):
        np.testing.assert_array_equal(getattr(first.data, name), getattr(memory.data, name))
    np.testing.assert_array_equal(first.logits, memory.logits)

    def fail(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(synthetic_module, "_fill", fail)
    again = synthetic_criteo(9000, seed=6, max_table_rows=200, cache_dir=tmp_path)
    assert isinstance(again.data.ids, np.memmap)
    np.testing.assert_array_equal(again.data.ids, memory.data.ids)
    with pytest.raises(AssertionError, match="generated again"):
        synthetic_criteo(9000, seed=7, max_table_rows=200, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1


def test_power_law_id_frequencies():
    ids = synthetic_criteo(20_000, seed=0, max_table_rows=10_000).data.ids[:, 2]
    counts = np.sort(np.bincount(ids))[::-1]
    # Zipf with s near 1: the top id is about twice as frequent as the second, ten times the tenth
    assert 1.5 < counts[0] / counts[1] < 2.6 and 6 < counts[0] / counts[9] < 15
    assert counts[0] / ids.size > 0.05


def test_click_rate_and_oracle_signal():
    log = synthetic_criteo(20_000, seed=2, max_table_rows=1000, click_rate=0.25)
    labels = log.data.labels
    assert labels.mean() == pytest.approx(0.25, abs=0.02)
    probs = 1.0 / (1.0 + np.exp(-log.logits.astype(np.float64)))
    oracle_ne = log_loss(labels, probs) / binary_entropy(labels.mean())
    assert roc_auc_score(labels, log.logits) > 0.75 and oracle_ne < 0.85


def test_logistic_regression_beats_the_base_rate():
    log = synthetic_criteo(12_000, seed=3, max_table_rows=50)
    one_hot = OneHotEncoder(handle_unknown="ignore").fit_transform(log.data.ids)
    features = sparse.hstack([sparse.csr_matrix(log.data.dense), one_hot]).tocsr()
    labels = log.data.labels
    model = LogisticRegression(C=0.5, solver="liblinear").fit(features[:8000], labels[:8000])
    probs = model.predict_proba(features[8000:])[:, 1]
    held_out = labels[8000:]
    ne = log_loss(held_out, probs) / binary_entropy(labels[:8000].mean())
    assert ne < 0.95 and roc_auc_score(held_out, probs) > 0.65


def test_splits_follow_line_order():
    log = synthetic_criteo(700, seed=0, max_table_rows=100)
    splits = log.splits()
    assert [len(splits[n]) for n in ("train", "test", "validation")] == [600, 50, 50]
    np.testing.assert_array_equal(splits["validation"].ids, log.data.ids[650:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows": 0}, "rows must be"),
        ({"rows": 10, "zipf_exponent": 1.0}, "zipf_exponent must be"),
        ({"rows": 10, "click_rate": 1.0}, "click_rate must be"),
        ({"rows": 10, "max_table_rows": 0}, "max_table_rows must be"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_criteo(**kwargs)


def test_a_damaged_cached_array_is_generated_again_and_replaced(tmp_path, cache_damage, monkeypatch):
    memory = synthetic_criteo(300, seed=2, max_table_rows=50)
    synthetic_criteo(300, seed=2, max_table_rows=50, cache_dir=tmp_path)
    (folder,) = tmp_path.iterdir()
    cache_damage(folder / "ids.npy")
    with cache_damage.rebuilt(folder / "ids.npy"):
        again = synthetic_criteo(300, seed=2, max_table_rows=50, cache_dir=tmp_path)
    for name in ("dense", "ids", "labels"):
        np.testing.assert_array_equal(getattr(again.data, name), getattr(memory.data, name))
    monkeypatch.setattr(synthetic_module, "_fill", lambda *args: pytest.fail("generated again"))
    read = synthetic_criteo(300, seed=2, max_table_rows=50, cache_dir=tmp_path)
    np.testing.assert_array_equal(read.data.ids, memory.data.ids)
    assert list(tmp_path.iterdir()) == [folder]
