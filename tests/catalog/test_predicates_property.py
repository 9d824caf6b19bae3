"""The job bitmap equals what DuckDB itself returns, for random predicates."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyroaring import BitMap

from tabloader.catalog import StatementError

N = 3000


@pytest.fixture(scope="module")
def table() -> pa.Table:
    rng = np.random.default_rng(11)
    label = rng.integers(0, 50, N)
    return pa.table(
        {
            "label": label,
            "split": rng.choice(["train", "val", "test"], N),
            "width": rng.integers(100, 900, N).astype(np.int32),
            "score": np.where(rng.random(N) < 0.1, np.nan, rng.random(N)),
            "name": pa.array([f"img_{i:05d}.jpg" if i % 7 else None for i in range(N)]),
        }
    )


@pytest.fixture(scope="module")
def env(table, tmp_path_factory):
    from tabloader import catalog

    cat = catalog.open_catalog(tmp_path_factory.mktemp("prop") / "cat")
    cat.import_arrow("t", table)
    con = duckdb.connect()  # an independent in-memory DuckDB as the oracle
    arrow = table.add_column(0, "_id", pa.array(np.arange(N, dtype=np.int64)))
    con.register("t", arrow)
    yield cat, con
    cat.close()
    con.close()


ints = st.integers(-5, 60).map(str)
comparisons = st.sampled_from(["<", "<=", ">", ">=", "=", "<>"])
atoms = st.one_of(
    st.builds(
        lambda c, op, v: f"{c} {op} {v}",
        st.sampled_from(["label", "width / 20", "_id % 50"]),
        comparisons,
        ints,
    ),
    st.builds(
        lambda vs: f"split IN ({', '.join(repr(v) for v in vs)})",
        st.lists(st.sampled_from(["train", "val", "test", "x"]), min_size=1, max_size=3),
    ),
    st.builds(lambda a, b: f"label BETWEEN {a} AND {b}", ints, ints),
    st.builds(lambda p: f"name LIKE '{p}'", st.sampled_from(["img_0%", "%5.jpg", "%", "_mg%"])),
    st.sampled_from(
        [
            "name IS NULL",
            "name IS NOT NULL",
            "isnan(score)",
            "score < 0.5",
            "hash(_id) % 10 < 3",
            "CAST(width AS DOUBLE) > 500.5",
            "upper(split) = 'VAL'",
            "label % 3 = 0 OR width > 800",
            "NOT (split = 'train')",
            "coalesce(name, 'none') = 'none'",
            "abs(label - 25) < 5",
        ]
    ),
)
predicates = st.recursive(
    atoms,
    lambda inner: st.one_of(
        st.builds(lambda a, b: f"({a}) AND ({b})", inner, inner),
        st.builds(lambda a, b: f"({a}) OR ({b})", inner, inner),
        st.builds(lambda a: f"NOT ({a})", inner),
    ),
    max_leaves=5,
)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(predicate=predicates)
def test_job_bitmap_matches_duckdb(env, predicate):
    cat, con = env
    oracle = BitMap(r[0] for r in con.execute(f"SELECT _id FROM t WHERE {predicate}").fetchall())
    if not oracle:
        with pytest.raises(StatementError, match="would have no rows"):
            cat.register_job("p", "t", where=predicate, replace=True)
        return
    job = cat.register_job("p", "t", where=predicate, replace=True)
    assert job.ids == oracle
    assert cat.job("p").ids == oracle
