"""PrefixTree and tree_plan: hand-built trees with exact values, properties against brute force."""

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.tree import PrefixTree, plan_balance, tree_plan

IGNORE = -100


# ---------------------------------------------------------------------- brute-force references


def _segment_of(tree, position):
    for i, (start, length) in enumerate(zip(tree.starts, tree.lengths)):
        if start <= position < start + length:
            return i
    raise AssertionError(position)


def _path(tree, segment):
    path = [segment]
    while tree.parents[path[-1]] != -1:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def _path_positions(tree, segments):
    return [p for s in segments for p in range(tree.starts[s], tree.starts[s] + tree.lengths[s])]


def _visible_loop(tree, queries, keys):
    out = torch.zeros(len(queries), len(keys), dtype=torch.bool)
    for i, q in enumerate(queries):
        for j, k in enumerate(keys):
            if 0 <= q < tree.seq_len and 0 <= k <= q:
                out[i, j] = _segment_of(tree, k) in _path(tree, _segment_of(tree, q))
    return out


def _conv_tail_walk(tree, width):
    rows = []
    for s in range(tree.num_segments):
        before = _path_positions(tree, _path(tree, s)[:-1])
        tail = before[-width:] if width else []
        rows.append([-1] * (width - len(tail)) + tail)
    return torch.tensor(rows, dtype=torch.int64).view(tree.num_segments, width)


@st.composite
def trees(draw, max_segments=12, max_length=6):
    n = draw(st.integers(1, max_segments))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    lengths = [draw(st.integers(1, max_length)) for _ in range(n)]
    return PrefixTree(parents, lengths)


def _grpo(prompt, completions, length):
    return PrefixTree([-1] + [0] * completions, [prompt] + [length] * completions)


# ---------------------------------------------------------------------- hand-built trees


def test_grpo_tree_exact():
    # prompt of 5, completions of 3, 2 and 1 tokens.
    tree = PrefixTree([-1, 0, 0, 0], [5, 3, 2, 1])
    assert tree.parents == (-1, 0, 0, 0) and tree.lengths == (5, 3, 2, 1)
    assert tree.starts == (0, 5, 8, 10) and tree.seq_len == 11 and tree.num_segments == 4
    assert tree.children == ((1, 2, 3), (), (), ()) and tree.depth == (0, 1, 1, 1)
    assert tree.max_children == 3 and tree.leaves() == (1, 2, 3)
    assert tree.ancestors(2) == (0,) and tree.ancestors(0) == ()
    assert tree.describe() == (4, 11, tree.fingerprint) and 0 <= tree.fingerprint < 2**63
    assert tree.segment_index().tolist() == [0] * 5 + [1] * 3 + [2] * 2 + [3]
    assert tree.position_ids().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 5]
    assert [p.tolist() for p in tree.leaf_positions()] == [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 8, 9],
        [0, 1, 2, 3, 4, 10],
    ]
    assert [c.tolist() for c in tree.leaf_label_columns()] == [
        [0] * 8,
        [0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 2, 0],
    ]
    x = IGNORE
    labels = tree.labels(torch.arange(100, 111, dtype=torch.int32))
    assert labels.dtype == torch.int64
    assert labels.tolist() == [
        [101, x, x],
        [102, x, x],
        [103, x, x],
        [104, x, x],
        [105, 108, 110],
        [106, x, x],
        [107, x, x],
        [x, x, x],
        [109, x, x],
        [x, x, x],
        [x, x, x],
    ]
    assert tree.fork_positions().tolist() == [4]
    assert tree.conv_tail_positions(3).tolist() == [[-1, -1, -1]] + [[2, 3, 4]] * 3
    assert tree.conv_tail_positions(7).tolist() == [[-1] * 7] + [[-1, -1, 0, 1, 2, 3, 4]] * 3
    assert tree.conv_tail_positions(0).shape == (4, 0)
    keys = torch.arange(-1, 11)
    assert tree.visible(torch.tensor([9]), keys).int().tolist() == [
        [0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0]
    ]
    assert tree.visible(torch.tensor([-1, 10]), torch.tensor([4, 5, 10, -1])).tolist() == [
        [False, False, False, False],
        [True, False, True, False],
    ]


def test_deep_forest_exact():
    # 0 -> 1 -> {3 -> 7, 4}; 2 -> 5; 6 alone. Three roots, depth 3, a single-child chain
    # (0 -> 1 and 3 -> 7), one-token segments (3 and the leaf 4), a root without children (6).
    tree = PrefixTree([-1, 0, -1, 1, 1, 2, -1, 3], [3, 2, 2, 1, 1, 3, 2, 2])
    assert tree.starts == (0, 3, 5, 7, 8, 9, 12, 14) and tree.seq_len == 16
    assert tree.children == ((1,), (3, 4), (5,), (7,), (), (), (), ())
    assert tree.depth == (0, 1, 0, 2, 2, 1, 0, 3) and tree.max_children == 2
    assert tree.leaves() == (4, 5, 6, 7) and tree.ancestors(7) == (0, 1, 3)
    assert tree.position_ids().tolist() == [0, 1, 2, 3, 4, 0, 1, 5, 5, 2, 3, 4, 0, 1, 6, 7]
    assert [p.tolist() for p in tree.leaf_positions()] == [
        [0, 1, 2, 3, 4, 8],
        [5, 6, 9, 10, 11],
        [12, 13],
        [0, 1, 2, 3, 4, 7, 14, 15],
    ]
    assert [c.tolist() for c in tree.leaf_label_columns()] == [
        [0, 0, 0, 0, 1, 0],
        [0] * 5,
        [0] * 2,
        [0] * 8,
    ]
    x = IGNORE
    expected = [[101, x], [102, x], [103, x], [104, x], [107, 108], [106, x], [109, x]]
    expected += [[114, x], [x, x], [110, x], [111, x], [x, x], [113, x], [x, x], [115, x]]
    expected += [[x, x]]
    assert tree.labels(torch.arange(100, 116)).tolist() == expected
    assert tree.fork_positions().tolist() == [4]
    assert tree.conv_tail_positions(4).tolist() == [
        [-1, -1, -1, -1],
        [-1, 0, 1, 2],
        [-1, -1, -1, -1],
        [1, 2, 3, 4],
        [1, 2, 3, 4],
        [-1, -1, 5, 6],
        [-1, -1, -1, -1],
        [2, 3, 4, 7],
    ]
    # row 15 (leaf 7) sees its whole path; row 11 (segment 5) sees roots 2 and itself.
    mask = tree.visible(torch.tensor([15, 11]), torch.arange(16))
    assert torch.nonzero(mask[0]).flatten().tolist() == [0, 1, 2, 3, 4, 7, 14, 15]
    assert torch.nonzero(mask[1]).flatten().tolist() == [5, 6, 9, 10, 11]


def test_single_segment_and_chain():
    one = PrefixTree([-1], [1])
    assert one.seq_len == 1 and one.leaves() == (0,) and one.max_children == 1
    assert one.labels(torch.tensor([7])).tolist() == [[IGNORE]]
    assert one.fork_positions().tolist() == [] and one.fork_positions().dtype == torch.int64
    chain = PrefixTree([-1, 0, 1, 2], [2, 1, 1, 3])
    assert chain.position_ids().tolist() == list(range(7))
    assert chain.leaf_positions()[0].tolist() == list(range(7))
    assert chain.labels(torch.arange(7))[:, 0].tolist() == list(range(1, 7)) + [IGNORE]
    assert torch.equal(chain.visible(torch.arange(7), torch.arange(7)), torch.ones(7, 7).tril() > 0)
    assert chain.conv_tail_positions(2).tolist() == [[-1, -1], [0, 1], [1, 2], [2, 3]]


def test_inputs_as_tensors_and_numpy_ints():
    a = PrefixTree(torch.tensor([-1, 0, 0], dtype=torch.int32), torch.tensor([2, 1, 1]))
    b = PrefixTree([-1, 0, 0], [2, 1, 1])
    assert a == b and hash(a) == hash(b) and a.fingerprint == b.fingerprint
    assert PrefixTree([-1, 0, 0], [2, 1, 2]) != b
    assert PrefixTree([-1, -1, 0], [2, 1, 1]).fingerprint != b.fingerprint


@pytest.mark.parametrize(
    "parents,lengths,match",
    [
        ([], [], "at least one segment"),
        ([-1, 0], [1], "parents has 2 entries but lengths has 1"),
        ([-1, 0, 0, 5], [1, 1, 1, 1], "segment 3: parent 5 is not an earlier segment"),
        ([-1, 1], [1, 1], "segment 1: parent 1 is not an earlier segment"),
        ([0], [1], "segment 0: parent 0 is not an earlier segment"),
        ([-1, -2], [1, 1], "segment 1: parent -2"),
        ([-1, 0, 0], [3, 0, 1], "segment 1: length 0 is not a positive int"),
        ([-1, 0], [3, -2], "segment 1: length -2"),
        ([-1, 0], [3, True], "segment 1: length entry must be an int, got bool"),
        ([-1, False], [3, 1], "segment 1: parent entry must be an int, got bool"),
        ([-1, 0], [3, 1.0], "segment 1: length entry must be an int, got float"),
        ([-1, 0], torch.tensor([1.0, 2.0]), "integer dtype"),
        ([-1, 0], torch.tensor([True, True]), "integer dtype"),
    ],
)
def test_invalid_trees_name_the_segment(parents, lengths, match):
    with pytest.raises(ValueError, match=match):
        PrefixTree(parents, lengths)


def test_bad_arguments():
    tree = PrefixTree([-1, 0], [3, 2])
    with pytest.raises(ValueError, match="7 positions but the PrefixTree has seq_len 5"):
        tree.check_seq_len(7)
    tree.check_seq_len(5)
    with pytest.raises(ValueError, match="seq_len 5"):
        tree.labels(torch.arange(6))
    with pytest.raises(ValueError, match="1-D"):
        tree.labels(torch.arange(5).view(1, 5))
    with pytest.raises(ValueError, match="integer"):
        tree.labels(torch.zeros(5))
    with pytest.raises(ValueError, match="segment 2 out of range"):
        tree.ancestors(2)
    with pytest.raises(ValueError, match="width"):
        tree.conv_tail_positions(-1)
    with pytest.raises(ValueError, match="key_positions"):
        tree.visible(torch.arange(2), torch.zeros(2))
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="cp_size"):
            tree_plan(tree, bad)
        with pytest.raises(ValueError, match="block"):
            tree_plan(tree, 2, block=bad)
    with pytest.raises(ValueError, match="PrefixTree"):
        tree_plan([3, 2], 2)
    with pytest.raises(ValueError, match="6 positions but the PrefixTree has seq_len 5"):
        plan_balance(tree, ContextParallelPlan.contiguous(6, 2))


def test_immutable_and_pickle_round_trip():
    tree = PrefixTree([-1, 0, 0, -1], [4, 2, 3, 1])
    with pytest.raises(AttributeError, match="immutable"):
        tree.seq_len = 3
    with pytest.raises(AttributeError, match="immutable"):
        tree.extra = 1
    # returned tensors are copies: editing one leaves the tree's caches alone
    tree.segment_index()[0] = 99
    tree.position_ids()[0] = 99
    tree.leaf_positions()[0][0] = 99
    assert tree.segment_index()[0] == 0 and tree.position_ids()[0] == 0
    assert tree.leaf_positions()[0][0] == 0
    tree.visible(torch.arange(3), torch.arange(3))  # fill the device caches before pickling
    tree.labels(torch.arange(10))
    copy = pickle.loads(pickle.dumps(tree))
    assert copy == tree and copy.describe() == tree.describe() and copy is not tree
    assert torch.equal(copy.labels(torch.arange(10)), tree.labels(torch.arange(10)))
    assert copy.children == tree.children and copy.depth == tree.depth
    assert repr(copy) == "PrefixTree(num_segments=4, seq_len=10, roots=2, leaves=3)"


# ---------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(trees())
def test_paths_position_ids_and_labels(tree):
    leaves = tree.leaves()
    paths = tree.leaf_positions()
    columns = tree.leaf_label_columns()
    assert len(paths) == len(columns) == len(leaves)
    position_ids = tree.position_ids()
    ids = torch.randint(0, 1000, (tree.seq_len,))
    labels = tree.labels(ids)
    assert labels.shape == (tree.seq_len, tree.max_children)
    expected = torch.full_like(labels, IGNORE)
    covered = set()
    for leaf, path, cols in zip(leaves, paths, columns):
        segments = _path(tree, leaf)
        assert path.tolist() == _path_positions(tree, segments)  # root first, contiguous
        assert position_ids[path].tolist() == list(range(path.numel()))
        flat = torch.cat([ids[path[1:]], torch.tensor([IGNORE])])
        assert torch.equal(labels[path, cols], flat)
        expected[path[:-1], cols[:-1]] = ids[path[1:]]
        covered.update(path.tolist())
    assert covered == set(range(tree.seq_len))
    assert torch.equal(labels, expected)  # nothing outside the paths' next tokens
    forks = tree.fork_positions()
    assert forks.tolist() == sorted(forks.tolist())
    if tree.max_children > 1:
        rows = torch.nonzero((labels[:, 1:] != IGNORE).any(1)).flatten()
        assert rows.tolist() == forks.tolist()
    seg = tree.segment_index()
    assert seg.tolist() == [_segment_of(tree, p) for p in range(tree.seq_len)]
    assert tree.depth == tuple(len(tree.ancestors(s)) for s in range(tree.num_segments))


@settings(max_examples=40, deadline=None)
@given(trees(max_segments=8, max_length=4), st.data())
def test_visible_and_conv_tail_match_brute_force(tree, data):
    positions = list(range(-1, tree.seq_len))
    queries = data.draw(st.lists(st.sampled_from(positions), max_size=12))
    keys = data.draw(st.lists(st.sampled_from(positions), max_size=12))
    got = tree.visible(torch.tensor(queries, dtype=torch.int64), torch.tensor(keys).long())
    assert got.dtype == torch.bool and got.shape == (len(queries), len(keys))
    assert torch.equal(got, _visible_loop(tree, queries, keys))
    full = torch.arange(tree.seq_len, dtype=torch.int32)
    assert torch.equal(tree.visible(full, full), _visible_loop(tree, full.tolist(), full.tolist()))
    width = data.draw(st.integers(0, 9))
    assert torch.equal(tree.conv_tail_positions(width), _conv_tail_walk(tree, width))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_flat_forest_is_same_sequence_causal(lengths):
    tree = PrefixTree([-1] * len(lengths), lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(tree.seq_len)
    expected = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    assert torch.equal(tree.visible(pos, pos), expected)
    assert tree.leaves() == tuple(range(len(lengths))) and tree.max_children == 1
    assert tree.fork_positions().numel() == 0
    starts = torch.tensor(tree.starts)
    assert torch.equal(tree.position_ids(), pos - starts[seq])


@settings(max_examples=40, deadline=None)
@given(trees(max_segments=10, max_length=20), st.integers(1, 6), st.integers(1, 9))
def test_tree_plan_owns_every_position_once(tree, cp, block):
    plan = tree_plan(tree, cp, block=block)
    assert plan.cp_size == cp and plan.seq_len == tree.seq_len and plan.cu_seqlens is None
    rows = [plan.local_positions(r) for r in range(cp)]
    assert torch.equal(torch.cat(rows).sort().values, torch.arange(tree.seq_len))
    for r in rows:
        assert torch.equal(r, r.sort().values)  # ascending source order
    share = -(-tree.seq_len // cp)
    assert max(plan.counts) <= share + min(block, share)
    assert tree_plan(tree, cp, block=block) == plan  # deterministic
    balance = plan_balance(tree, plan)
    assert sum(balance["tokens"]) == tree.seq_len
    assert sum(balance["work"]) == int((tree.position_ids() + 1).sum())


def test_plan_balance_values():
    tree = PrefixTree([-1, 0], [2, 2])  # work per row 1, 2, 3, 4
    balance = plan_balance(tree, ContextParallelPlan.contiguous(4, 2))
    assert balance["work"] == (3, 7) and balance["tokens"] == (2, 2)
    assert balance["work_max"] == 7 and balance["work_mean"] == 5.0
    assert balance["work_ratio"] == 1.4 and balance["tokens_ratio"] == 1.0
    assert tree_plan(tree, 2, block=1).local_positions(0).tolist() == [0, 3]
    assert plan_balance(tree, tree_plan(tree, 2, block=1))["work"] == (5, 5)


def test_tree_plan_small_tree_gives_every_rank_rows():
    tree = PrefixTree([-1, 0, 0], [4, 3, 3])
    plan = tree_plan(tree, 4)  # block 64 shrinks to ceil(10 / 4) = 3
    assert all(c > 0 for c in plan.counts) and sum(plan.counts) == 10


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("prompt,completions,length", [(4096, 8, 1024), (16384, 16, 512)])
def test_tree_plan_balances_grpo_better_than_contiguous(prompt, completions, length, cp):
    tree = _grpo(prompt, completions, length)
    ours = plan_balance(tree, tree_plan(tree, cp))
    contiguous = plan_balance(tree, ContextParallelPlan.contiguous(tree.seq_len, cp))
    print(
        f"\nGRPO {prompt}+{completions}x{length} cp={cp}: tree_plan work max/mean "
        f"{ours['work_ratio']:.4f} tokens {ours['tokens_ratio']:.4f}; contiguous work "
        f"{contiguous['work_ratio']:.4f} tokens {contiguous['tokens_ratio']:.4f}"
    )
    assert ours["work_ratio"] <= contiguous["work_ratio"]
    assert ours["work_ratio"] < 1.01 and ours["tokens_ratio"] <= 1.0 + 64 * cp / tree.seq_len
