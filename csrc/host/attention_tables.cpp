// Host builders of the fused attention's per-batch tables, registered as CPU torch ops
// (namespace megatron_cp_host).
//
// megatron/context_parallel/attention/runs.py and blocks.py hold the definitions, a
// torch-op reference of each builder; the two are kept equal field by field
// (tests/attention/test_tables_native.py).
// The reference issues about a hundred small torch ops per batch, each paying the dispatcher
// and an allocation: milliseconds on the host where one layer's attention takes tens of them.
// Here every table is one or two linear passes over the batch's rows.
//
// All tensors are int64, contiguous, on the CPU. Scalars cross as int64 lists.

#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace megatron_cp_host {
namespace {

using Vec = std::vector<int64_t>;

const int64_t* read(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": expected a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, what, ": expected int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), what, ": expected a contiguous 1-D tensor");
  return t.data_ptr<int64_t>();
}

at::Tensor tensor(const Vec& v) {
  at::Tensor out = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
  std::copy(v.begin(), v.end(), out.data_ptr<int64_t>());
  return out;
}

at::Tensor none() { return at::empty({0}, at::kLong); }

// A fresh int64 tensor of n elements and its data (written by the caller).
std::pair<at::Tensor, int64_t*> alloc(int64_t n) {
  at::Tensor t = at::empty({n}, at::kLong);
  return {t, t.data_ptr<int64_t>()};
}

// Each position's sequence start (the first position of its sequence): the compact keys'
// sequence starts where every position is owned. For non-decreasing ids (checked in one
// comparison pass) each sequence's end is found by galloping and its starts written as one
// fill; other ids by a pass that starts anew at each change.
at::Tensor sequence_starts(const at::Tensor& sequence) {
  const int64_t* seq = read(sequence, "sequence_starts: sequence");
  const int64_t s_len = sequence.numel();
  at::Tensor out = at::empty({s_len}, at::kLong);
  int64_t* kst = out.data_ptr<int64_t>();
  bool sorted = true;
  for (int64_t k = 1; k < s_len; ++k) sorted &= seq[k] >= seq[k - 1];
  if (!sorted) {
    int64_t start = 0;  // in a register: through kst[k - 1] each step waits on a store
    for (int64_t k = 0; k < s_len; ++k) {
      if (k > 0 && seq[k] != seq[k - 1]) start = k;
      kst[k] = start;
    }
    return out;
  }
  for (int64_t start = 0; start < s_len;) {
    const int64_t end = std::upper_bound(seq + start, seq + s_len, seq[start]) - seq;
    std::fill(kst + start, kst + end, start);
    start = end;
  }
  return out;
}

// The owned positions in source order (compact keys): for each its all-gather slot, packed
// sequence and its sequence's first compact key; and each position's compact key (an unowned
// position holds its predecessor's, -1 before the first owned one).
// Where every position is owned (no padding, the common case) the compact keys are the
// positions themselves: the slots are row_source, the sequences are `sequence` and each
// position is its own key, so only the sequence starts are written and the other three come
// back empty (the caller reads its own tensors; CompactKeys). At S = 131,072 that leaves one
// pass and 1 MB written of the 4 MB and four passes a full layout costs.
std::vector<at::Tensor> compact_keys(const at::Tensor& row_source, const at::Tensor& sequence) {
  const int64_t* src = read(row_source, "compact_keys: row_source");
  const int64_t* seq = read(sequence, "compact_keys: sequence");
  const int64_t s_len = row_source.numel();
  TORCH_CHECK(sequence.numel() == s_len, "compact_keys: ", s_len, " positions but ",
              sequence.numel(), " sequence ids");
  int64_t count = 0;
  for (int64_t p = 0; p < s_len; ++p) count += src[p] >= 0;
  if (count == s_len) return {none(), none(), none(), sequence_starts(sequence)};
  at::Tensor slots = at::empty({count}, at::kLong), of_position = at::empty({s_len}, at::kLong);
  at::Tensor key_seq = at::empty({count}, at::kLong), key_start = at::empty({count}, at::kLong);
  int64_t *sl = slots.data_ptr<int64_t>(), *of = of_position.data_ptr<int64_t>();
  int64_t *ks = key_seq.data_ptr<int64_t>(), *kst = key_start.data_ptr<int64_t>();
  int64_t k = 0, start = 0;
  for (int64_t p = 0; p < s_len; ++p) {
    if (src[p] >= 0) {
      if (k > 0 && ks[k - 1] != seq[p]) start = k;
      kst[k] = start;
      sl[k] = src[p];
      ks[k] = seq[p];
      ++k;
    }
    of[p] = k - 1;
  }
  return {slots, of_position, key_seq, key_start};
}

// Calls of consecutive items (at least one each, in order) that packing greedily up to
// `budget` makes.
int64_t greedy_calls(const Vec& size, int64_t budget) {
  int64_t calls = 0, total = 0;
  for (size_t i = 0; i < size.size(); ++i) {
    if (i == 0 || total + size[i] > budget) {
      ++calls;
      total = 0;
    }
    total += size[i];
  }
  return calls;
}

// The smallest budget <= `budget` under which greedy packing makes no more calls than under
// `budget`: the same calls, the largest as small as consecutive calls allow.
int64_t balanced_budget(const Vec& size, int64_t budget) {
  const int64_t calls = greedy_calls(size, budget);
  int64_t lo = 1, hi = std::max<int64_t>(budget, 1);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (greedy_calls(size, mid) <= calls) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// One rank's rows as compact keys, made once per batch and rank (rank_keys) and read by
// every layout builder and cost below: `sorted`, the rank's keys in ascending order, and
// `order`, the local row of each sorted key (null when the local rows already come in key
// order, as in every run plan). Pointers into tensors the caller holds.
struct RankKeys {
  const int64_t* sorted = nullptr;
  const int64_t* order = nullptr;
  int64_t n = 0;

  bool ascending() const { return order == nullptr; }
  int64_t local_of_sorted(int64_t i) const { return order ? order[i] : i; }
};

// The rank keys a builder is handed (rank_keys' output), checked before they index anything:
// ascending keys within [0, num_keys), local rows within [0, n). Read-only passes, a few tens
// of microseconds at S = 131,072.
RankKeys read_rank_keys(const at::Tensor& sorted, const at::Tensor& order, int64_t num_keys,
                        const char* what) {
  RankKeys rk;
  rk.sorted = read(sorted, what);
  rk.n = sorted.numel();
  bool ascending = true;
  for (int64_t i = 1; i < rk.n; ++i) ascending &= rk.sorted[i] > rk.sorted[i - 1];
  TORCH_CHECK(ascending && (rk.n == 0 || (rk.sorted[0] >= 0 && rk.sorted[rk.n - 1] < num_keys)),
              what, ": the sorted keys must ascend within the ", num_keys, " keys");
  if (order.numel() > 0) {
    TORCH_CHECK(order.numel() == rk.n, what, ": ", order.numel(), " local rows for ", rk.n,
                " keys");
    rk.order = read(order, what);
    bool in_range = true;
    for (int64_t i = 0; i < rk.n; ++i) in_range &= rk.order[i] >= 0 && rk.order[i] < rk.n;
    TORCH_CHECK(in_range, what, ": a local row outside the ", rk.n, " rows");
  }
  return rk;
}

// The compact key of local row i: of_position[positions[i]], or the position itself where
// of_position is empty (every position owned: compact_keys).
inline int64_t key_of(const int64_t* pos, const int64_t* of, int64_t i) {
  return of ? of[pos[i]] : pos[i];
}

// key_of, the position checked within the `s_len` positions and its key within the `num_keys`
// keys (an unowned position maps outside them or onto another's key, which the callers'
// ascending or once-only checks then catch); `what` names the caller in the errors.
inline int64_t checked_key(const int64_t* pos, const int64_t* of, int64_t i, int64_t s_len,
                           int64_t num_keys, const char* what) {
  TORCH_CHECK(pos[i] >= 0 && pos[i] < s_len, what, ": position ", pos[i], " out of range");
  const int64_t k = key_of(pos, of, i);
  TORCH_CHECK(k >= 0 && k < num_keys, what, ": local position ", pos[i],
              " is not an owned position of its own");
  return k;
}

// Ascending keys as pieces: maximal stretches of consecutive keys of one sequence (kstart: each
// key's sequence start, which names its sequence). For strictly ascending keys, "keys[i..j] are
// consecutive and of keys[i]'s sequence" holds for j up to the piece's end and fails after
// (keys[j] - j never decreases, nor kstart along the keys), so the end of a piece of L keys is
// found in O(log L) probes by galloping. A run plan's rows are a few long pieces; a scattered
// plan's are short ones of unpredictable length, which a pass key by key reads faster (no
// branch on each piece's end).

// Whether keys[i, i + len) are consecutive and of keys[i]'s sequence.
inline bool consecutive(const int64_t* keys, const int64_t* kstart, int64_t i, int64_t len) {
  const int64_t lo = keys[i], last = keys[i + len - 1];
  return last - lo == len - 1 && kstart[last] == kstart[lo];
}

// The length of the piece from keys[i] on, at least `known` (consecutive(i, known) holds).
int64_t piece_end(const int64_t* keys, int64_t n, const int64_t* kstart, int64_t i,
                  int64_t known) {
  const int64_t most = n - i;
  int64_t good = known, step = std::max<int64_t>(known, 1);
  while (good + step <= most && consecutive(keys, kstart, i, good + step)) good += step, step *= 2;
  for (step /= 2; step > 0; step /= 2) {
    if (good + step <= most && consecutive(keys, kstart, i, good + step)) good += step;
  }
  return good;
}

// Reads ascending keys in order: on_key(i, key) key by key, except that a piece of more than
// kLong keys goes to on_piece(i, lo, len) whole (found by galloping).
constexpr int64_t kLong = 16;

template <typename Key, typename Stretch>
void walk_keys(const int64_t* keys, int64_t n, const int64_t* kstart, Key&& on_key,
               Stretch&& on_piece) {
  for (int64_t i = 0; i < n;) {
    if (i + kLong < n && consecutive(keys, kstart, i, kLong + 1)) {
      const int64_t len = piece_end(keys, n, kstart, i, kLong + 1);
      on_piece(i, keys[i], len);
      i += len;
    } else {
      on_key(i, keys[i]);
      ++i;
    }
  }
}

// Calls f(first, lo, len) for each piece of ascending keys, in key order: its first index in
// `keys`, first key and length.
template <typename F>
void for_each_piece(const int64_t* keys, int64_t n, const int64_t* kstart, F&& f) {
  for (int64_t i = 0; i < n;) {
    const int64_t len = piece_end(keys, n, kstart, i, 1);
    f(i, keys[i], len);
    i += len;
  }
}

// The spans of ascending keys (the run tables' entries where rows are not their own runs):
// keys of one sequence less than the merge gap apart. Calls f(first, lo, len) for each span:
// its first index in the keys, its first key and its length in keys (dummies included).
template <typename F>
void for_each_span(const int64_t* keys, int64_t n, const int64_t* kstart, int64_t gap_limit,
                   F&& f) {
  int64_t first = -1, lo = 0, last = 0;  // the open span: keys[first] = lo, ..., last
  auto extend = [&](int64_t i, int64_t k, int64_t to) {
    if (first >= 0 && (k - last > gap_limit || kstart[k] != kstart[lo])) {
      f(first, lo, last + 1 - lo);
      first = -1;
    }
    if (first < 0) first = i, lo = k;
    last = to;
  };
  walk_keys(
      keys, n, kstart, [&](int64_t i, int64_t k) { extend(i, k, k); },
      [&](int64_t i, int64_t k, int64_t len) { extend(i, k, k + len - 1); });
  if (first >= 0) f(first, lo, last + 1 - lo);
}

// The rows' own causal score elements of ascending keys (each key's keys from its sequence's
// first to itself); a piece of L keys from `lo` in a sequence starting at s sums lo - s + 1,
// ..., lo - s + L.
int64_t keys_work(const int64_t* keys, int64_t n, const int64_t* kstart) {
  int64_t work = 0;
  walk_keys(
      keys, n, kstart, [&](int64_t, int64_t k) { work += k - kstart[k] + 1; },
      [&](int64_t, int64_t lo, int64_t len) {
        work += len * (lo - kstart[lo] + 1) + len * (len - 1) / 2;
      });
  return work;
}

// One rank's rows as compact keys (RankKeys): returns (sorted, order) and
// [work, sorted_is_positions]. Each local position is checked in range and owned once; `work`
// is the rows' own causal score elements (each row's keys from its sequence's start to itself).
// Rows in key order are their own order: `order` comes back empty, and where the keys are the
// positions themselves `sorted` too (sorted_is_positions: the caller's `positions` are the
// sorted keys), so a run plan's keys cost one comparison pass and its work a few probes per
// run (keys_work). Otherwise a counting pass.
std::tuple<std::vector<at::Tensor>, std::vector<int64_t>> rank_keys(
    const at::Tensor& positions, const at::Tensor& of_position,
    const at::Tensor& key_sequence_start) {
  const int64_t* pos = read(positions, "rank_keys: positions");
  const int64_t* of = of_position.numel() > 0 ? read(of_position, "rank_keys: of_position")
                                              : nullptr;
  const int64_t* kstart = read(key_sequence_start, "rank_keys: key_sequence_start");
  const int64_t n = positions.numel(), num_keys = key_sequence_start.numel();
  const int64_t s_len = of ? of_position.numel() : num_keys;
  if (!of) {
    // Each position its own key: positions ascending within the keys are the sorted keys, and
    // their work comes piece by piece.
    bool ascending = true;
    for (int64_t i = 1; i < n; ++i) ascending &= pos[i] > pos[i - 1];
    if (ascending && (n == 0 || (pos[0] >= 0 && pos[n - 1] < num_keys))) {
      return {{none(), none()}, {keys_work(pos, n, kstart), 1}};
    }
  }
  int64_t work = 0;
  bool ascending = true;
  int64_t previous = -1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = checked_key(pos, of, i, s_len, num_keys, "rank_keys");
    work += k - kstart[k] + 1;
    ascending = ascending && k > previous;
    previous = k;
  }
  if (ascending) {  // of_position given: the fast path above took the positions themselves
    at::Tensor sorted;
    int64_t* out;
    std::tie(sorted, out) = alloc(n);
    for (int64_t i = 0; i < n; ++i) out[i] = of[pos[i]];
    return {{sorted, none()}, {work, 0}};
  }
  Vec local_of_key(num_keys, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = key_of(pos, of, i);
    TORCH_CHECK(local_of_key[k] < 0, "rank_keys: local position ", pos[i],
                " is not an owned position of its own");
    local_of_key[k] = i;
  }
  at::Tensor sorted, order;
  int64_t *by_key, *local;
  std::tie(sorted, by_key) = alloc(n);
  std::tie(order, local) = alloc(n);
  int64_t j = 0;
  for (int64_t k = 0; k < num_keys; ++k) {
    if (local_of_key[k] < 0) continue;
    by_key[j] = k;
    local[j++] = local_of_key[k];
  }
  return {{sorted, order}, {work, 0}};
}

// Packs each entry's key-gradient rows in the order of its query rows (not the kernel's entry
// order), so that entries with neighbouring query rows have neighbouring key-gradient rows and
// a backward cut into windows of both (AttentionRuns.backward_windows) gets narrow windows.
// Writes mat_start and returns the row total.
int64_t lay_out_by_rows(const Vec& q_start, const Vec& kv_len, Vec& mat_start) {
  const int64_t entries = static_cast<int64_t>(q_start.size());
  Vec order(entries);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return q_start[a] < q_start[b]; });
  int64_t rows = 0;
  for (int64_t e : order) {
    mat_start[e] = rows;
    rows += kv_len[e];
  }
  return rows;
}

// The entries of one rank's rows (AttentionRuns.build), from its keys (rank_keys: `sorted`,
// `order`). Returns the tensors
//   q_start, q_len, k_start, kv_len, mat_start, span_source, local_to_span, entry_copy
// (empty where the flags say absent) and the flags
//   identity, query_rows, materialize, mat_rows, keys_covered, copies.
std::tuple<std::vector<at::Tensor>, std::vector<int64_t>> run_tables(
    const at::Tensor& positions, const at::Tensor& of_position, const at::Tensor& sorted_keys,
    const at::Tensor& sorted_order, const at::Tensor& key_sequence,
    const at::Tensor& key_sequence_start, int64_t padding_rows, int64_t merge_gap,
    bool longest_first) {
  const int64_t* pos = read(positions, "run_tables: positions");
  const int64_t* of = of_position.numel() > 0 ? read(of_position, "run_tables: of_position")
                                              : nullptr;
  const int64_t* kseq = read(key_sequence, "run_tables: key_sequence");
  const int64_t* kstart = read(key_sequence_start, "run_tables: key_sequence_start");
  const int64_t n = positions.numel();
  const int64_t num_keys = key_sequence_start.numel();
  const int64_t gap_limit = std::max<int64_t>(merge_gap, 1);

  const RankKeys rk = read_rank_keys(sorted_keys, sorted_order, num_keys, "run_tables: rank keys");
  TORCH_CHECK(rk.n == n, "run_tables: ", rk.n, " rank keys for ", n, " local rows");
  const int64_t* sorted = rk.sorted;
  // Spans: the sorted keys' pieces (consecutive keys of one sequence), merged.
  Vec span_lo, span_len, span_first;
  for_each_span(sorted, n, kstart, gap_limit, [&](int64_t first, int64_t lo, int64_t len) {
    span_first.push_back(first), span_lo.push_back(lo), span_len.push_back(len);
  });
  const int64_t spans = static_cast<int64_t>(span_lo.size());
  const int64_t span_rows = std::accumulate(span_len.begin(), span_len.end(), int64_t{0});
  // The local rows in their own order as runs of consecutive keys of one sequence: the entries
  // where they are also the spans (`identity`). Rows in key order are the sorted keys, their
  // runs the pieces; otherwise a checking pass over the local positions.
  Vec run_start, run_len, run_lo;
  if (rk.ascending()) {
    for_each_piece(sorted, n, kstart, [&](int64_t first, int64_t lo, int64_t len) {
      run_start.push_back(first), run_lo.push_back(lo), run_len.push_back(len);
    });
  } else {
    const int64_t s_len = of ? of_position.numel() : num_keys;
    for (int64_t i = 0, before = -1; i < n; ++i) {
      const int64_t k = checked_key(pos, of, i, s_len, num_keys, "run_tables");
      if (i == 0 || k - before != 1 || kseq[k] != kseq[before]) {
        run_start.push_back(i);
        run_len.push_back(0);
        run_lo.push_back(k);
      }
      ++run_len.back();
      before = k;
    }
  }
  const bool identity = span_rows == n && static_cast<int64_t>(run_start.size()) == spans;
  Vec q_start, q_len, lo;
  at::Tensor span_source = none(), local_to_span = none();
  int64_t query_rows;
  if (identity) {
    q_start.swap(run_start), q_len.swap(run_len), lo.swap(run_lo);
    query_rows = n + padding_rows;
  } else {
    query_rows = span_rows;
    q_len = span_len;
    lo = span_lo;
    q_start.resize(spans);
    int64_t* source;
    int64_t* to_span;
    std::tie(span_source, source) = alloc(span_rows);
    std::tie(local_to_span, to_span) = alloc(n);
    // Span rows of keys the rank does not own are dummies (-1); the sorted keys of span s are
    // its owned ones.
    std::fill(source, source + span_rows, -1);
    int64_t row = 0;
    for (int64_t s = 0; s < spans; ++s) {
      q_start[s] = row;
      const int64_t end = s + 1 < spans ? span_first[s + 1] : n;
      for (int64_t i = span_first[s]; i < end; ++i) {
        const int64_t local = rk.local_of_sorted(i), at = row + sorted[i] - span_lo[s];
        source[at] = local;
        to_span[local] = at;
      }
      row += span_len[s];
    }
  }
  const int64_t entries = static_cast<int64_t>(q_len.size());
  Vec k_start(entries), kv_len(entries);
  for (int64_t e = 0; e < entries; ++e) {
    k_start[e] = kstart[lo[e]];
    kv_len[e] = lo[e] + q_len[e] - k_start[e];
  }
  if (longest_first && entries > 1) {
    Vec order(entries);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return kv_len[a] > kv_len[b]; });
    auto permute = [&](Vec& v) {
      Vec out(entries);
      for (int64_t e = 0; e < entries; ++e) out[e] = v[order[e]];
      v.swap(out);
    };
    permute(q_start), permute(q_len), permute(lo), permute(k_start), permute(kv_len);
  }
  // Entries of one sequence share keys: each then writes key gradients to rows of its own.
  bool materialize = false;
  if (entries > 1) {
    Vec seqs(entries);
    for (int64_t e = 0; e < entries; ++e) seqs[e] = kseq[lo[e]];
    std::sort(seqs.begin(), seqs.end());
    materialize = std::adjacent_find(seqs.begin(), seqs.end()) != seqs.end();
  }
  // Each entry writes its own key-gradient rows; a key's copies are summed into its slot by
  // slot_copies, which the device derives from the per-entry tables (AttentionRuns
  // .slot_copies): row j of it holds each key's copy in the entry of copy number j. Every entry
  // of a sequence starts at the sequence's first key, so one with more keys covers every key of
  // one with fewer: numbered by key count, longest first, the entries covering a key are copies
  // 0, 1, ... of it, whatever the key.
  Vec mat_start = k_start, entry_copy(entries, 0);
  int64_t mat_rows = num_keys, copies = 1;
  if (materialize) {
    mat_rows = lay_out_by_rows(q_start, kv_len, mat_start);
    Vec order(entries);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const int64_t sa = kseq[lo[a]], sb = kseq[lo[b]];
      return sa != sb ? sa < sb : kv_len[a] > kv_len[b];
    });
    int64_t number = 0;
    for (int64_t i = 0; i < entries; ++i) {
      const bool same = i > 0 && kseq[lo[order[i]]] == kseq[lo[order[i - 1]]];
      number = same ? number + 1 : 0;
      entry_copy[order[i]] = number;
      copies = std::max(copies, number + 1);
    }
  }
  // Without copies, a key past the rank's last row of its sequence is attended by no entry.
  // Every entry starts at its sequence's first key, and without copies no two share one, so
  // the keys are covered when every sequence's entry reaches that sequence's end: counted by
  // binary searches of the (non-decreasing) key sequences, not a pass over the keys.
  bool keys_covered = false;
  if (entries > 0 && !materialize) {
    const int64_t* kend = kseq + num_keys;
    int64_t sequences = 0;
    for (const int64_t* k = kseq; k != kend; k = std::upper_bound(k, kend, *k)) ++sequences;
    int64_t whole = 0;
    for (int64_t e = 0; e < entries; ++e) {
      const int64_t end = std::upper_bound(kseq + k_start[e], kend, kseq[k_start[e]]) - kseq;
      whole += k_start[e] + kv_len[e] == end;
    }
    keys_covered = whole == sequences;
  }
  std::vector<at::Tensor> out = {tensor(q_start), tensor(q_len),     tensor(k_start),
                                 tensor(kv_len),  tensor(mat_start),   span_source,
                                 local_to_span,   tensor(entry_copy)};
  std::vector<int64_t> flags = {identity, query_rows, materialize, mat_rows, keys_covered, copies};
  return {out, flags};
}

// One call's per-entry tables (q_start, q_len, k_start, kv_len, mat_start), read and checked to
// be of one length.
struct Entries {
  const int64_t *qs, *ql, *ks, *kl, *ms;
  int64_t n;
};

Entries read_entries(const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& k_start,
                     const at::Tensor& kv_len, const at::Tensor& mat_start, const char* what) {
  const int64_t n = q_len.numel();
  for (const at::Tensor* t : {&q_start, &k_start, &kv_len, &mat_start}) {
    TORCH_CHECK(t->numel() == n, what, ": per-entry tables of unequal lengths");
  }
  return {read(q_start, what), read(q_len, what), read(k_start, what), read(kv_len, what),
          read(mat_start, what), n};
}

// The device layout of one kernel call (AttentionRuns._host_tables): per-entry lengths and
// starts padded to `batch` entries (padding entries and the closing offset point past the last
// row). Returns seq_len_q, seq_len_kv, q_rows, kv_rows, mat_rows.
std::vector<at::Tensor> call_tables(const at::Tensor& q_start, const at::Tensor& q_len,
                                    const at::Tensor& k_start, const at::Tensor& kv_len,
                                    const at::Tensor& mat_start, int64_t batch, int64_t max_q,
                                    int64_t query_rows, int64_t num_keys, int64_t mat_rows) {
  const auto [qs, ql, ks, kl, ms, entries] =
      read_entries(q_start, q_len, k_start, kv_len, mat_start, "call_tables");
  TORCH_CHECK(entries <= batch, "call_tables: ", entries, " entries over a batch of ", batch);
  at::Tensor len_q = at::zeros({batch}, at::kLong), len_kv = at::zeros({batch}, at::kLong);
  at::Tensor q_rows = at::empty({batch + 1}, at::kLong);
  at::Tensor kv_rows = at::empty({batch + 1}, at::kLong);
  at::Tensor m_rows = at::empty({batch + 1}, at::kLong);
  int64_t *lq = len_q.data_ptr<int64_t>(), *lk = len_kv.data_ptr<int64_t>();
  int64_t *qr = q_rows.data_ptr<int64_t>(), *kr = kv_rows.data_ptr<int64_t>();
  int64_t *mr = m_rows.data_ptr<int64_t>();
  for (int64_t e = 0; e <= batch; ++e) {
    const bool real = e < entries;
    if (e < batch) {
      lq[e] = real ? ql[e] : 0;
      lk[e] = real ? kl[e] : 0;
    }
    qr[e] = real ? qs[e] : query_rows;
    kr[e] = real ? ks[e] : num_keys;
    mr[e] = real ? ms[e] : mat_rows;
    TORCH_CHECK(!real || ql[e] <= max_q, "call_tables: entry of ", ql[e], " rows over max_q ",
                max_q);
  }
  return {len_q, len_kv, q_rows, kv_rows, m_rows};
}

// A causal call's backward as a prefix call and a diagonal call (AttentionRuns.backward_split,
// whose torch ops define it): each entry's first kv_len - q_len keys unmasked (entries without
// any left out) and its last q_len keys a square causal block, split only where the entries'
// rectangles exceed `margin` times their visible pairs. Returns nothing (no split), or the two
// calls' q_start, q_len, k_start, kv_len, mat_start and
//   [every entry has a prefix, then per call its key total, longest rows and longest keys].
std::tuple<std::vector<at::Tensor>, std::vector<int64_t>> split_tables(
    const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& k_start,
    const at::Tensor& kv_len, const at::Tensor& mat_start, double margin) {
  const auto [qs, ql, ks, kl, ms, entries] =
      read_entries(q_start, q_len, k_start, kv_len, mat_start, "split_tables");
  int64_t rectangle = 0, visible = 0, with_prefix = 0;
  for (int64_t e = 0; e < entries; ++e) {
    const int64_t prefix = kl[e] - ql[e];
    TORCH_CHECK(prefix >= 0, "split_tables: an entry with fewer keys than rows");
    rectangle += ql[e] * kl[e];
    visible += ql[e] * prefix + ql[e] * (ql[e] + 1) / 2;
    with_prefix += prefix > 0;
  }
  if (with_prefix == 0 || !(static_cast<double>(rectangle) > margin * visible)) return {{}, {}};
  Vec p_qs, p_ql, p_ks, p_kl, p_ms, d_ks(entries), d_ms(entries);
  int64_t p_keys = 0, p_max_q = 0, p_max_kv = 0, d_keys = 0, d_max_q = 0;
  for (int64_t e = 0; e < entries; ++e) {
    const int64_t prefix = kl[e] - ql[e];
    d_ks[e] = ks[e] + prefix;
    d_ms[e] = ms[e] + prefix;
    d_keys += ql[e];
    d_max_q = std::max(d_max_q, ql[e]);
    if (prefix == 0) continue;
    p_qs.push_back(qs[e]), p_ql.push_back(ql[e]), p_ks.push_back(ks[e]);
    p_kl.push_back(prefix), p_ms.push_back(ms[e]);
    p_keys += prefix;
    p_max_q = std::max(p_max_q, ql[e]);
    p_max_kv = std::max(p_max_kv, prefix);
  }
  std::vector<at::Tensor> out = {tensor(p_qs),  tensor(p_ql), tensor(p_ks), tensor(p_kl),
                                 tensor(p_ms),  q_start.clone(), q_len.clone(), tensor(d_ks),
                                 q_len.clone(), tensor(d_ms)};
  return {out, {with_prefix == entries, p_keys, p_max_q, p_max_kv, d_keys, d_max_q, d_max_q}};
}

// The per-entry host tables of a group of kernel calls copied together (staging._GroupLayout
// .host_tables, whose torch ops define them), from per call m its padded entries batch[m],
// max_q[m], first statistics slot stats_at[m], first key-source row kv_at[m] and key-source
// rows kv_rows[m]. Per entry of every call: its row in the per-entry row regions (each call's
// tables there hold one closing offset more), its first statistics slot, its call's first
// key-source row, and whether that call has key sources.
std::vector<at::Tensor> group_tables(at::IntArrayRef batch, at::IntArrayRef max_q,
                                     at::IntArrayRef stats_at, at::IntArrayRef kv_at,
                                     at::IntArrayRef kv_rows) {
  const size_t calls = batch.size();
  TORCH_CHECK(max_q.size() == calls && stats_at.size() == calls && kv_at.size() == calls &&
                  kv_rows.size() == calls,
              "group_tables: per-call lists of unequal lengths");
  int64_t entries = 0;
  for (const int64_t b : batch) {
    TORCH_CHECK(b >= 0, "group_tables: a call of ", b, " entries");
    entries += b;
  }
  at::Tensor row, stats, at_kv, take;
  int64_t *r, *st, *ak, *tk;
  std::tie(row, r) = alloc(entries);
  std::tie(stats, st) = alloc(entries);
  std::tie(at_kv, ak) = alloc(entries);
  std::tie(take, tk) = alloc(entries);
  int64_t e = 0;
  for (size_t m = 0; m < calls; ++m) {
    for (int64_t local = 0; local < batch[m]; ++local, ++e) {
      r[e] = e + static_cast<int64_t>(m);
      st[e] = stats_at[m] + local * max_q[m];
      ak[e] = kv_at[m];
      tk[e] = kv_rows[m] > 0;
    }
  }
  return {row, stats, at_kv, take};
}

// Score elements a tiled kernel computes for entries (blocks._tile_cost): whole query
// tiles of `tile` rows, a causal tile running to the key bound of its last row.
int64_t entry_tile_cost(int64_t q, int64_t kv, bool causal, int64_t tile) {
  const int64_t tiles = (q + tile - 1) / tile;
  if (!causal) return tiles * tile * kv;
  int64_t cost = 0;
  for (int64_t k = 0; k < tiles; ++k) cost += tile * (kv - q + std::min((k + 1) * tile, q));
  return cost;
}

double tile_cost(const at::Tensor& q_len, const at::Tensor& kv_len, bool causal, int64_t tile) {
  const int64_t* q = read(q_len, "tile_cost: q_len");
  const int64_t* kv = read(kv_len, "tile_cost: kv_len");
  TORCH_CHECK(kv_len.numel() == q_len.numel() && tile >= 1, "tile_cost: bad arguments");
  int64_t cost = 0;
  for (int64_t e = 0; e < q_len.numel(); ++e) cost += entry_tile_cost(q[e], kv[e], causal, tile);
  return static_cast<double>(cost);
}

// What the layout choice reads of the run tables (runs.run_entries then
// blocks._tile_cost), without laying out a table: the entries' causal tile cost, from the
// rank's sorted keys (rank_keys). The entries are run_tables' spans: sorted keys of one
// sequence closer than the merge gap, each attending its sequence's keys up to its end. A plan
// that scatters a rank's rows gives it about one entry per row, so this pass, not the tables,
// decides.
double run_cost(const at::Tensor& sorted_keys, const at::Tensor& key_sequence_start,
                int64_t merge_gap, int64_t tile) {
  const int64_t* kstart = read(key_sequence_start, "run_cost: key_sequence_start");
  const RankKeys rk =
      read_rank_keys(sorted_keys, none(), key_sequence_start.numel(), "run_cost: rank keys");
  TORCH_CHECK(tile >= 1, "run_cost: tile must be positive");
  const int64_t gap_limit = std::max<int64_t>(merge_gap, 1);
  int64_t cost = 0;
  for_each_span(rk.sorted, rk.n, kstart, gap_limit, [&](int64_t, int64_t lo, int64_t len) {
    cost += entry_tile_cost(len, lo + len - kstart[lo], true, tile);
  });
  return static_cast<double>(cost);
}

// One kernel call of the blocked layout (AttentionRuns.from_entries): its entries longest
// first and, when it runs backward, each entry's own rows of key gradients.
struct Call {
  Vec q_start, q_len, k_start, kv_len, mat_start;
  at::Tensor span_source = none(), local_to_span = none();
  int64_t query_rows = 0, mat_rows = 0;

  void finish(bool backward, int64_t num_keys) {
    const int64_t entries = static_cast<int64_t>(q_len.size());
    if (entries > 1) {
      Vec order(entries);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return kv_len[a] > kv_len[b]; });
      for (Vec* v : {&q_start, &q_len, &k_start, &kv_len}) {
        Vec out(entries);
        for (int64_t e = 0; e < entries; ++e) out[e] = (*v)[order[e]];
        v->swap(out);
      }
    }
    if (!backward) {
      mat_start = k_start;
      mat_rows = num_keys;
      return;
    }
    // The compact key of each of these rows (kv_source) is made on the device from them.
    mat_start.resize(entries);
    mat_rows = lay_out_by_rows(q_start, kv_len, mat_start);
  }

  void append(std::vector<at::Tensor>& out) const {
    for (const Vec* v : {&q_start, &q_len, &k_start, &kv_len, &mat_start}) {
      out.push_back(tensor(*v));
    }
    out.insert(out.end(), {span_source, local_to_span});
  }
};

// Groups of the blocked layout: up to group_rows consecutive sorted rows of one sequence. Per
// group its first sorted row and row count, its first and last compact key (lo, hi), its
// sequence's first key (start), its index in its sequence and its sequence's group count.
struct Groups {
  Vec first, length, lo, hi, start, index, size;
};

Groups make_groups(const int64_t* sorted, int64_t n, const int64_t* kstart, int64_t group_rows) {
  Groups gr;
  for (Vec* v : {&gr.first, &gr.length, &gr.lo, &gr.hi, &gr.start, &gr.index, &gr.size}) {
    v->reserve(n / group_rows + 64);
  }
  int64_t seq_first = 0, seq_groups = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool new_seq = i == 0 || kstart[sorted[i]] != kstart[sorted[i - 1]];
    if (new_seq) {  // the previous sequence's groups now know their count
      const int64_t groups_so_far = static_cast<int64_t>(gr.size.size());
      for (int64_t g = groups_so_far - seq_groups; g < groups_so_far; ++g) gr.size[g] = seq_groups;
      seq_first = i, seq_groups = 0;
    }
    if (new_seq || (i - seq_first) % group_rows == 0) {
      gr.first.push_back(i);
      gr.length.push_back(0);
      gr.lo.push_back(sorted[i]);
      gr.hi.push_back(sorted[i]);
      gr.start.push_back(kstart[sorted[i]]);
      gr.index.push_back((i - seq_first) / group_rows);
      gr.size.push_back(0);
      ++seq_groups;
    }
    ++gr.length.back();
    gr.hi.back() = sorted[i];
  }
  const int64_t groups = static_cast<int64_t>(gr.first.size());
  for (int64_t g = groups - seq_groups; g < groups; ++g) gr.size[g] = seq_groups;
  return gr;
}

// The blocked layout of one rank's rows (AttentionBlocks.build). Returns the tensors
//   order, local_to_sorted (both empty when the rows come in key order), has_bulk (empty: every
//   group has bulk keys), slot_rows (empty when the slots are the compact keys), then 7 per
//   call (q_start, q_len, k_start, kv_len, mat_start, span_source, local_to_span) for the bulk
//   call (when present), each diagonal call and each backward level call;
// and the ints
//   groups, identity (the local rows are sorted), bulk present, diagonal calls, level calls,
//   then per call (bulk, diagonal, levels) its query_rows, mat_rows, key total, longest rows
//   and longest keys, then per diagonal call its first and end sorted row.
std::tuple<std::vector<at::Tensor>, std::vector<int64_t>> block_tables(
    const at::Tensor& sorted_keys, const at::Tensor& sorted_order, const at::Tensor& key_slots,
    const at::Tensor& key_sequence_start, int64_t group_rows, int64_t span_budget, int64_t slots,
    bool slots_in_source_order) {
  const int64_t* kslot = read(key_slots, "block_tables: key_slots");
  const int64_t* kstart = read(key_sequence_start, "block_tables: key_sequence_start");
  const int64_t num_keys = key_sequence_start.numel();
  const RankKeys rk =
      read_rank_keys(sorted_keys, sorted_order, num_keys, "block_tables: rank keys");
  const int64_t n = rk.n;
  TORCH_CHECK(key_slots.numel() == num_keys, "block_tables: ", key_slots.numel(),
              " key slots for ", num_keys, " keys");
  TORCH_CHECK(n > 0, "block_tables: the blocked layout needs rows");
  TORCH_CHECK(group_rows >= 1, "block_tables: group_rows must be positive, got ", group_rows);

  const int64_t* sorted = rk.sorted;
  const bool identity = rk.ascending();
  // The local row of each sorted row and back: the identity (not written) for rows in key order.
  Vec sorted_of_key(num_keys, -1), order, local_to_sorted;
  for (int64_t i = 0; i < n; ++i) sorted_of_key[sorted[i]] = i;
  if (!identity) {
    order.assign(rk.order, rk.order + n);
    local_to_sorted.resize(n);
    for (int64_t i = 0; i < n; ++i) local_to_sorted[order[i]] = i;
  }
  Groups gr = make_groups(sorted, n, kstart, group_rows);
  const Vec &first = gr.first, &length = gr.length, &lo = gr.lo, &hi = gr.hi, &start = gr.start;
  const Vec &index = gr.index, &size = gr.size;
  const int64_t groups = static_cast<int64_t>(first.size());

  std::vector<Call> calls;
  std::vector<int64_t> call_meta;
  // The bulk: every group's unmasked key prefix, forward only.
  Vec has_bulk;
  bool all_bulk = true, any_bulk = false;
  for (int64_t g = 0; g < groups; ++g) {
    all_bulk = all_bulk && lo[g] > start[g];
    any_bulk = any_bulk || lo[g] > start[g];
  }
  if (!all_bulk) {
    has_bulk.reserve(n);
    for (int64_t g = 0; g < groups; ++g) {
      has_bulk.insert(has_bulk.end(), length[g], lo[g] > start[g]);
    }
  }
  if (any_bulk) {
    Call c;
    for (int64_t g = 0; g < groups; ++g) {
      if (lo[g] <= start[g]) continue;
      c.q_start.push_back(first[g]), c.q_len.push_back(length[g]);
      c.k_start.push_back(start[g]), c.kv_len.push_back(lo[g] - start[g]);
    }
    c.query_rows = n;
    c.finish(false, num_keys);
    calls.push_back(std::move(c));
  }
  // Diagonal spans, at most span_budget span rows a call (at least one group), balanced:
  // packed in as few calls as the budget allows, under the smallest budget that still does.
  Vec span(groups);
  for (int64_t g = 0; g < groups; ++g) span[g] = hi[g] - lo[g] + 1;
  const int64_t budget = balanced_budget(span, span_budget);
  Vec diag_bounds;
  int64_t diagonal = 0;
  for (int64_t g = 0; g < groups;) {
    int64_t e = g, total = 0;
    while (e < groups && (e == g || total + span[e] <= budget)) {
      total += span[e];
      ++e;
    }
    Call c;
    c.query_rows = total;
    int64_t *source, *to_span;
    std::tie(c.span_source, source) = alloc(total);
    std::tie(c.local_to_span, to_span) = alloc(first[e - 1] + length[e - 1] - first[g]);
    int64_t row = 0;
    for (int64_t h = g; h < e; ++h) {
      const int64_t len = hi[h] - lo[h] + 1;
      c.q_start.push_back(row), c.q_len.push_back(len);
      c.k_start.push_back(lo[h]), c.kv_len.push_back(len);
      for (int64_t j = 0; j < len; ++j) source[row + j] = sorted_of_key[lo[h] + j];
      for (int64_t i = first[h]; i < first[h] + length[h]; ++i)
        to_span[i - first[g]] = row + sorted[i] - lo[h];
      row += len;
    }
    diag_bounds.push_back(first[g]);
    diag_bounds.push_back(first[e - 1] + length[e - 1]);
    c.finish(true, num_keys);
    calls.push_back(std::move(c));
    ++diagonal;
    g = e;
  }
  // The backward's bulk, re-cut so that no call holds two entries with the same keys: pieces
  // j == i first, then one call per level of the pairs j < i.
  Vec piece_start(groups);
  for (int64_t g = 0; g < groups; ++g) piece_start[g] = index[g] == 0 ? start[g] : lo[g - 1];
  int64_t levels = 0;
  auto level_call = [&](Call&& c) {
    c.query_rows = n;
    c.finish(true, num_keys);
    ++levels;
    calls.push_back(std::move(c));
  };
  {
    Call c;
    for (int64_t g = 0; g < groups; ++g) {
      if (lo[g] <= piece_start[g]) continue;
      c.q_start.push_back(first[g]), c.q_len.push_back(length[g]);
      c.k_start.push_back(piece_start[g]), c.kv_len.push_back(lo[g] - piece_start[g]);
    }
    if (!c.q_len.empty()) level_call(std::move(c));
  }
  const int64_t max_size = *std::max_element(size.begin(), size.end());
  for (int64_t half = 1; half < max_size; half *= 2) {
    Call c;
    for (int64_t g = 0; g < groups; ++g) {
      if (index[g] % (2 * half) != half) continue;  // a leader opens its block's right half
      const int64_t last = g + std::min(half, size[g] - index[g]) - 1;
      const int64_t k_start = piece_start[g - half];
      const int64_t kv_len = lo[g - 1] - k_start;
      if (kv_len <= 0) continue;
      c.q_start.push_back(first[g]), c.q_len.push_back(first[last] + length[last] - first[g]);
      c.k_start.push_back(k_start), c.kv_len.push_back(kv_len);
    }
    if (!c.q_len.empty()) level_call(std::move(c));
  }

  Vec slot_rows;
  if (!slots_in_source_order) {
    slot_rows.assign(slots, -1);
    for (int64_t k = 0; k < num_keys; ++k) {
      TORCH_CHECK(kslot[k] >= 0 && kslot[k] < slots, "block_tables: key slot ", kslot[k],
                  " outside the ", slots, " slots");
      slot_rows[kslot[k]] = k;
    }
  }
  std::vector<at::Tensor> out = {tensor(order), tensor(local_to_sorted), tensor(has_bulk),
                                 tensor(slot_rows)};
  std::vector<int64_t> meta = {groups, identity, any_bulk, diagonal, levels};
  for (const Call& c : calls) {
    c.append(out);
    const int64_t key_rows = std::accumulate(c.kv_len.begin(), c.kv_len.end(), int64_t{0});
    const int64_t longest_q = *std::max_element(c.q_len.begin(), c.q_len.end());
    const int64_t longest_kv = *std::max_element(c.kv_len.begin(), c.kv_len.end());
    meta.insert(meta.end(), {c.query_rows, c.mat_rows, key_rows, longest_q, longest_kv});
  }
  meta.insert(meta.end(), diag_bounds.begin(), diag_bounds.end());
  return {out, meta};
}

// What the layout choice reads of the blocked layout (blocks._blocks_cost), without laying it
// out: the tile cost of its forward calls, every group's bulk keys [start, lo) unmasked and its
// diagonal span [lo, hi] causal.
double block_cost(const at::Tensor& sorted_keys, const at::Tensor& key_sequence_start,
                  int64_t group_rows, int64_t tile) {
  const int64_t* sorted =
      read_rank_keys(sorted_keys, none(), key_sequence_start.numel(), "block_cost: rank keys")
          .sorted;
  const int64_t* kstart = read(key_sequence_start, "block_cost: key_sequence_start");
  TORCH_CHECK(group_rows >= 1, "block_cost: group_rows must be positive, got ", group_rows);
  TORCH_CHECK(tile >= 1, "block_cost: tile must be positive");
  const Groups gr = make_groups(sorted, sorted_keys.numel(), kstart, group_rows);
  int64_t cost = 0;
  for (size_t g = 0; g < gr.first.size(); ++g) {
    const int64_t bulk = gr.lo[g] - gr.start[g];
    if (bulk > 0) cost += entry_tile_cost(gr.length[g], bulk, false, tile);
    const int64_t span = gr.hi[g] - gr.lo[g] + 1;
    cost += entry_tile_cost(span, span, true, tile);
  }
  return static_cast<double>(cost);
}

}  // namespace

TORCH_LIBRARY(megatron_cp_host, m) {
  m.def("compact_keys(Tensor row_source, Tensor sequence) -> Tensor[]", &compact_keys);
  m.def("sequence_starts(Tensor sequence) -> Tensor", &sequence_starts);
  m.def(
      "rank_keys(Tensor positions, Tensor of_position, Tensor key_sequence_start) "
      "-> (Tensor[], int[])",
      &rank_keys);
  m.def(
      "run_tables(Tensor positions, Tensor of_position, Tensor sorted_keys, Tensor sorted_order, "
      "Tensor key_sequence, Tensor key_sequence_start, int padding_rows, int merge_gap, "
      "bool longest_first) -> (Tensor[], int[])",
      &run_tables);
  m.def(
      "call_tables(Tensor q_start, Tensor q_len, Tensor k_start, Tensor kv_len, "
      "Tensor mat_start, int batch, int max_q, int query_rows, int num_keys, int mat_rows) "
      "-> Tensor[]",
      &call_tables);
  m.def(
      "split_tables(Tensor q_start, Tensor q_len, Tensor k_start, Tensor kv_len, "
      "Tensor mat_start, float margin) -> (Tensor[], int[])",
      &split_tables);
  m.def(
      "group_tables(int[] batch, int[] max_q, int[] stats_at, int[] kv_at, int[] kv_rows) "
      "-> Tensor[]",
      &group_tables);
  m.def("tile_cost(Tensor q_len, Tensor kv_len, bool causal, int tile) -> float", &tile_cost);
  m.def(
      "run_cost(Tensor sorted_keys, Tensor key_sequence_start, int merge_gap, int tile) "
      "-> float",
      &run_cost);
  m.def(
      "block_tables(Tensor sorted_keys, Tensor sorted_order, Tensor key_slots, "
      "Tensor key_sequence_start, int group_rows, int span_budget, int slots, "
      "bool slots_in_source_order) -> (Tensor[], int[])",
      &block_tables);
  m.def(
      "block_cost(Tensor sorted_keys, Tensor key_sequence_start, int group_rows, int tile) "
      "-> float",
      &block_cost);
}

}  // namespace megatron_cp_host

// Importing megatron.context_parallel._host registers the ops above; the module itself is empty.
extern "C" PyObject* PyInit__host(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
