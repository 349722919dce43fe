import itertools

import pytest

from autopar.layout.placement import P, R, Partial, Replicate, Shard, TensorSpec, parse_placement


@pytest.mark.parametrize(
    "text, compact",
    [("S0R", "S0R"), ("S(0),R", "S0R"), ("S(0)R", "S0R"), ("RR", "RR"), ("P", "P"),
     ("S0S0", "S0S0"), ("S(12)S1", "S(12)S1"), (" S1 , P ", "S1P")],
)
def test_parse_print_round_trip(text, compact):
    spec = TensorSpec.parse(text)
    assert str(spec) == compact
    assert TensorSpec.parse(str(spec)) == spec


def test_placement_strings():
    assert str(Shard(0)) == "S(0)" and str(R) == "R" and str(P) == "P"
    assert parse_placement("S(3)") == Shard(3)
    assert Replicate() == R and Partial() == P and hash(Shard(1)) == hash(Shard(1))


@pytest.mark.parametrize("bad", ["", "X", "S", "SR", "S0Q", "RR,,x"])
def test_parse_errors_echo_input(bad):
    with pytest.raises(ValueError, match="spec"):
        TensorSpec.parse(bad)


def test_local_shape_and_uneven_error():
    spec = TensorSpec.parse("S0S1")
    assert spec.local_shape((8, 6), (2, 3)) == (4, 2)
    assert TensorSpec.parse("S0S0").local_shape((8, 6), (2, 2)) == (2, 6)
    with pytest.raises(ValueError, match=r"dim 1 of shape \(8, 6\).*not divisible by 4"):
        TensorSpec.parse("RS1").local_shape((8, 6), (2, 4))
    with pytest.raises(ValueError, match="has only 2 dims"):
        TensorSpec.parse("S2R").validate((8, 6), (2, 2))
    with pytest.raises(ValueError, match="2 axes"):
        TensorSpec.parse("S0").validate((8, 6), (2, 2))


def test_local_slices_tile_the_tensor_exactly():
    shape, mesh = (8, 12, 4), (2, 2, 3)
    for text in ["S0S0S1", "S1S0R", "PS2S1", "RRR", "S1S1S1"]:
        spec = TensorSpec.parse(text)
        if not spec.is_valid(shape, mesh):
            continue
        seen = {}
        for coord in itertools.product(*map(range, mesh)):
            key = tuple((s.start, s.stop) for s in spec.local_slices(shape, mesh, coord))
            seen.setdefault(key, []).append(coord)
        # every distinct slice is one tile; tiles times local size covers the global tensor
        local = spec.local_shape(shape, mesh)
        num_tiles = 1
        for d in range(len(shape)):
            num_tiles *= shape[d] // local[d]
        assert len(seen) == num_tiles, text


def test_zero_split_picks_a_dim_whose_shards_nest_above_the_replicated_axes():
    from autopar.layout.placement import zero_split

    spec = TensorSpec.parse
    assert zero_split(spec("RR"), 2, (2, 2)) == (0, (0, 1))
    assert zero_split(spec("S0R"), 2, (2, 2)) == (0, (1,))  # S0 on axis 0, then axis 1 splits further
    assert zero_split(spec("RS0"), 2, (2, 2)) == (1, (0,))  # axis 0 would split dim 0 before axis 1
    assert zero_split(spec("RS0"), 1, (2, 2)) is None  # a 1-D tensor has no other dim
    assert zero_split(spec("S0S1"), 2, (2, 2)) is None  # nothing replicated
    assert zero_split(spec("RR"), 2, (1, 2)) == (0, (1,))  # a size-1 axis splits nothing
    assert zero_split(spec("R"), 0, (2,)) is None


def test_segmented_shard_prints_parses_validates_and_indexes():
    """``S(d/k)``: each of the k equal segments of dim d split over the axis (a fused q|k|v)."""
    from autopar.layout.placement import zero_split

    spec = TensorSpec.parse("RS(1/3)")
    assert spec.placements == (R, Shard(1, 3)) and str(spec) == "RS(1/3)" and spec != TensorSpec.parse("RS1")
    assert str(Shard(2, 3)) == "S(2/3)" and TensorSpec.parse("S(2/3),R") == TensorSpec((Shard(2, 3), R))
    assert spec.local_shape((4, 12), (2, 2)) == (4, 6)
    # coordinate 1 of the axis holds the second half of every segment: q_1 | k_1 | v_1
    assert spec.local_index((4, 12), (2, 2), (0, 1)) == (slice(0, 4), (2, 3, 6, 7, 10, 11))
    with pytest.raises(ValueError, match="segmented shard: its local piece is not one slice"):
        spec.local_slices((4, 12), (2, 2), (0, 1))
    with pytest.raises(ValueError, match="not divisible by 6 .3 segment"):
        TensorSpec.parse("S(0/3)").validate((8,), (2,))
    with pytest.raises(ValueError, match="sharded by one mesh axis only"):
        TensorSpec.parse("S0S(0/3)").validate((12,), (2, 2))
    with pytest.raises(ValueError, match="segments must be a positive int"):
        Shard(0, 0)
    assert zero_split(TensorSpec.parse("RS(0/3)"), 2, (2, 2)) == (1, (0,))  # ZeRO never cuts the segments
    assert zero_split(TensorSpec.parse("RS(0/3)"), 1, (2, 2)) is None
