// One layer's cache step (validate + RESOLVE + fetch + commit) as one XLA FFI call
// on the CPU: the contract of reference.py's ``resolve_fetch_reference``, in place.
//
// Why a native call: XLA:CPU runs the XLA RESOLVE as ~140 small ops per layer and
// the Pallas kernels interpreted as a loop of them; the per-op cost, not the
// bytes, is what keeps the CPU step above full KV. This is the CPU twin of the
// fused Pallas kernels (kernel.py), the same algorithm per (request, unit) row,
// O(B + k): a position -> lane map of the selection (set per row, cleared after
// it, one map per thread kept across calls), probed with the slots' positions;
// the walk of the slots in LRU order, SGLang's victim order. It decides every row
// first and writes only when no row refused (a refused layer changes nothing but
// slot B), as the two Pallas launches do. Rows, then the copies of missed rows,
// run on the calling thread and XLA's intra-op pool (``ParallelFor``). Metadata no step
// writes (an LRU or victim order that is not a permutation, a page past the host
// tier, buffers that do not fit the shapes) is an error before any write.
//
// Shapes (glossary: kvtier_jax/shapes.py): L layers, R requests, U units per
// request, B regular slots (+1 reserved for the newest token), k selected lanes,
// T = max_len, Pg page size, NH host pages, Hg heads per unit, D head dim.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kStatusOutOfRange = 1;  // pallas_kernels/common.py
constexpr int32_t kStatusDuplicate = 2;
constexpr int32_t kStatusCapacity = 4;

// What classify decides for one row; commit writes it when the layer is ok.
struct RowPlan {
  std::vector<int32_t> new_pos, new_lru;  // [B]
  std::vector<float> new_score;           // [B] (the install slot's 1 included)
  int32_t target = -1, hits = 0, misses = 0, status = 0;
  const char* error = nullptr;  // metadata no step writes: the call fails
};

// ``counter += n`` modulo 2^32, as XLA's int32 add wraps (a signed overflow is
// undefined behaviour in C++; fetched_rows of a long-lived server may get there).
void WrappingAdd(int32_t& counter, int64_t n) {
  counter = static_cast<int32_t>(static_cast<uint32_t>(counter) + static_cast<uint32_t>(n));
}

// Whether ``ids`` (n slot ids) names every slot in [0, n) once; ``seen``: scratch [n].
bool IsPermutation(const int32_t* ids, int64_t n, std::vector<char>& seen) {
  std::fill(seen.begin(), seen.end(), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= n || seen[ids[i]]) return false;
    seen[ids[i]] = 1;
  }
  return true;
}

// A position's page-table column as XLA's gather reads it (clamped into the table).
int64_t LogicalPage(int64_t pos, int64_t max_len, int64_t page_size, int64_t max_pages) {
  return std::min(std::clamp<int64_t>(pos, 0, max_len - 1) / page_size, max_pages - 1);
}

struct RowCopy {
  char* to;
  const char* from;
};

// The fetch: rows scattered over the host tier, each read once, so latency-bound
// (a TLB and a cache miss per row). Prefetching the next rows' lines keeps
// several reads in flight (bench_decode's shape, 4 layers' calls: 0.80 -> ~0.68
// ms on the 2-core CI VM; 16 or 32 rows ahead read no better); chunks of rows
// run on both cores.
void CopyRows(const RowCopy* copies, size_t n, int64_t row_bytes) {
  constexpr size_t kAhead = 8;
  constexpr int64_t kLine = 64;
  auto prefetch = [&](const char* from) {
    for (int64_t b = 0; b < row_bytes; b += kLine) __builtin_prefetch(from + b);
  };
  for (size_t i = 0; i < std::min(kAhead, n); ++i) prefetch(copies[i].from);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch(copies[i + kAhead].from);
    std::memcpy(copies[i].to, copies[i].from, row_bytes);
  }
}

// fn(i) for every i in [0, n), on the calling thread and up to one thread fewer
// than XLA's intra-op pool has (one thread a core: the caller is the last).
// Items are claimed from a shared counter, so the caller waits only for items a
// helper already claimed, never for a helper that has not started (a busy pool
// means the caller does more). The counters outlive the call: a helper that
// starts late claims nothing and never touches ``fn``.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& fn) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [n](Counters& c, const F* f) {
    for (int64_t i = c.next.fetch_add(1); i < n; i = c.next.fetch_add(1)) {
      (*f)(i);
      c.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([counters, work, f = &fn] { work(*counters, f); });
  }
  work(*counters, &fn);
  while (counters->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// One thread's classify scratch, kept across calls. ``lane_of`` (position -> the
// selection lane naming it, -1 none) is set per row and cleared after it, so it
// is all -1 between rows; it grows with max_len.
struct Scratch {
  std::vector<int32_t> lane_of, sel, held, rank, by_rank, eff;
  std::vector<char> is_hit, taken, seen;
};

Scratch& ThreadScratch(int64_t max_len, int64_t num_sel, int64_t num_slots) {
  thread_local Scratch scratch;
  if (static_cast<int64_t>(scratch.lane_of.size()) < max_len + 1) {
    scratch.lane_of.resize(max_len + 1, -1);
  }
  for (auto* v : {&scratch.sel, &scratch.held}) v->resize(num_sel);
  for (auto* v : {&scratch.rank, &scratch.by_rank, &scratch.eff}) v->resize(num_slots);
  for (auto* v : {&scratch.is_hit, &scratch.taken, &scratch.seen}) v->resize(num_slots);
  return scratch;
}

template <typename T>
T* Alias(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  // XLA aliases each output to its input (input_output_aliases); copy if not.
  if (out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  return static_cast<T*>(out->untyped_data());
}

ffi::Error ResolveFetchImpl(
    ffi::BufferR0<ffi::S32> layer_buf,         // i32[]
    ffi::BufferR0<ffi::S32> prior_status_buf,  // i32[]
    ffi::BufferR1<ffi::PRED> active,           // bool[R]
    ffi::BufferR1<ffi::S32> seq_len,           // i32[R] newest position per request
    ffi::BufferR3<ffi::S32> selected,          // i32[R, U, k]
    ffi::BufferR3<ffi::S32> order,             // i32[R, U, B] victim order (keyed only)
    ffi::BufferR2<ffi::S32> page_table,        // i32[R, MP]
    ffi::AnyBuffer host_k,                   // [L, NH+1, Pg, U, Hg, D]
    ffi::AnyBuffer host_v,
    ffi::AnyBuffer k_new,                    // [R, U*Hg, D] in the hot cache's dtype
    ffi::AnyBuffer v_new,
    ffi::AnyBuffer slot_pos_in,  // i32[L, R, U, B]
    ffi::AnyBuffer lru_in,       // i32[L, R, U, B]
    ffi::AnyBuffer score_in,     // f32[L, R, U, B]
    ffi::AnyBuffer hits_in,      // i32[L, R, U]
    ffi::AnyBuffer misses_in,    // i32[L, R, U]
    ffi::AnyBuffer fetched_in,   // i32[L]
    ffi::AnyBuffer hot_k_in,     // [L, R, U, B+1, Hg, D]
    ffi::AnyBuffer hot_v_in,
    ffi::Result<ffi::AnyBuffer> slot_pos_out, ffi::Result<ffi::AnyBuffer> lru_out,
    ffi::Result<ffi::AnyBuffer> score_out, ffi::Result<ffi::AnyBuffer> hits_out,
    ffi::Result<ffi::AnyBuffer> misses_out, ffi::Result<ffi::AnyBuffer> fetched_out,
    ffi::Result<ffi::AnyBuffer> hot_k_out, ffi::Result<ffi::AnyBuffer> hot_v_out,
    ffi::ResultBuffer<ffi::S32> slot_out,    // i32[R, U, k]
    ffi::ResultBuffer<ffi::PRED> miss_out,   // bool[R, U, k]
    ffi::ResultBuffer<ffi::S32> status_out,  // i32[]
    ffi::ResultBuffer<ffi::S32> target_out,  // i32[R, U]
    int64_t max_len, int64_t page_size, int64_t share, int64_t keyed,
    float score_decay, ffi::ThreadPool pool) {
  if (slot_pos_in.dimensions().size() != 4 || host_k.dimensions().size() != 6 ||
      hot_k_in.dimensions().size() != 6) {
    return ffi::Error::InvalidArgument("slot metadata, host tier or hot cache of the "
                                       "wrong rank");
  }
  const auto pos_dims = slot_pos_in.dimensions();
  const int64_t num_layers = pos_dims[0], num_req = pos_dims[1], num_units = pos_dims[2],
                num_slots = pos_dims[3];
  const int64_t num_sel = selected.dimensions()[2];
  const int64_t max_pages = page_table.dimensions()[1];
  const auto host_dims = host_k.dimensions();
  const int64_t host_pages = host_dims[1];
  if (num_layers < 1 || num_req < 1 || num_units < 1 || num_slots < 1 || max_len < 1 ||
      page_size < 1 || share < 1) {
    return ffi::Error::InvalidArgument("an empty cache, or max_len, page_size or share "
                                       "below 1");
  }
  const int64_t row_bytes = hot_k_in.size_bytes() / (num_layers * num_req * num_units *
                                                     (num_slots + 1));
  const int32_t layer = layer_buf.typed_data()[0];
  const int32_t prior_status = prior_status_buf.typed_data()[0];
  if (layer < 0 || layer + share > num_layers) {
    return ffi::Error::InvalidArgument("layer + share is outside the cache's layers");
  }
  if (host_dims[2] != page_size) {
    return ffi::Error::InvalidArgument("the host tier's page axis is not page_size");
  }
  // The Python wrapper checks every shape at trace time; a mismatch here is a caller
  // that bypassed it, refused before any buffer is indexed.
  const int64_t rows = num_req * num_units;
  const auto hot_dims = hot_k_in.dimensions();
  const bool sizes_ok =
      hot_dims[0] == num_layers && hot_dims[1] == num_req && hot_dims[2] == num_units &&
      hot_dims[3] == num_slots + 1 && row_bytes > 0 && num_sel <= num_slots &&
      hot_v_in.size_bytes() == hot_k_in.size_bytes() &&
      host_v.size_bytes() == host_k.size_bytes() &&
      host_k.size_bytes() ==
          static_cast<size_t>(num_layers * host_pages * page_size * num_units * row_bytes) &&
      k_new.size_bytes() == static_cast<size_t>(rows * row_bytes) &&
      v_new.size_bytes() == k_new.size_bytes() &&
      active.element_count() == static_cast<size_t>(num_req) &&
      seq_len.element_count() == static_cast<size_t>(num_req) &&
      selected.element_count() == static_cast<size_t>(rows * num_sel) &&
      order.element_count() == static_cast<size_t>(rows * num_slots) &&
      page_table.dimensions()[0] == num_req && max_pages > 0 &&
      lru_in.size_bytes() == slot_pos_in.size_bytes() &&
      score_in.size_bytes() == slot_pos_in.size_bytes() &&
      hits_in.size_bytes() == static_cast<size_t>(4 * num_layers * rows) &&
      misses_in.size_bytes() == hits_in.size_bytes() &&
      fetched_in.size_bytes() == static_cast<size_t>(4 * num_layers);
  if (!sizes_ok) {
    return ffi::Error::InvalidArgument("buffer sizes do not fit the cache's shape");
  }

  int32_t* slot_pos = Alias<int32_t>(slot_pos_in, slot_pos_out);
  int32_t* lru = Alias<int32_t>(lru_in, lru_out);
  float* score = Alias<float>(score_in, score_out);
  int32_t* hits = Alias<int32_t>(hits_in, hits_out);
  int32_t* misses = Alias<int32_t>(misses_in, misses_out);
  int32_t* fetched = Alias<int32_t>(fetched_in, fetched_out);
  char* hot_k = Alias<char>(hot_k_in, hot_k_out);
  char* hot_v = Alias<char>(hot_v_in, hot_v_out);
  const bool* act = active.typed_data();
  const int32_t* seq = seq_len.typed_data();
  const int32_t* sel_all = selected.typed_data();
  const int32_t* pages = page_table.typed_data();
  int32_t* slot_all = slot_out->typed_data();
  bool* miss_all = miss_out->typed_data();
  int32_t* target_all = target_out->typed_data();

  const int64_t meta = rows * num_slots;  // one layer of slot metadata
  std::vector<RowPlan> plans(rows);

  // Classify: every row's verdict and new metadata, nothing written to the cache.
  // Rows are independent: they run on both cores (ParallelFor), each thread with
  // its own scratch.
  auto classify = [&](int64_t row) {
    Scratch& scratch = ThreadScratch(max_len, num_sel, num_slots);
    std::vector<int32_t>& lane_of = scratch.lane_of;
    std::vector<int32_t>&sel = scratch.sel, &held = scratch.held, &rank = scratch.rank,
                         &by_rank = scratch.by_rank, &eff = scratch.eff;
    std::vector<char>&is_hit = scratch.is_hit, &taken = scratch.taken,
                      &seen = scratch.seen;
    const int64_t req = row / num_units;
    const int32_t newest = seq[req];
    const bool on = act[req];
    const int64_t base = layer * meta + row * num_slots;
    RowPlan& plan = plans[row];
    // Metadata no step writes: refused before anything of the row is touched.
    const int32_t* lru_row = lru + base;
    const int32_t* walk = keyed ? order.typed_data() + row * num_slots : lru_row;
    if (!IsPermutation(lru_row, num_slots, seen) ||
        (keyed && !IsPermutation(walk, num_slots, seen))) {
      plan.error = "an LRU or victim order row is not a permutation of the slots";
      return;
    }
    bool bad = false, dup = false;
    for (int64_t j = 0; j < num_sel; ++j) {
      int32_t p = on ? sel_all[row * num_sel + j] : -1;
      if (p < -1 || p > newest || p > max_len) {
        bad = true;
        p = -1;
      }
      sel[j] = p;
    }
    // Index the selection by position (a lane seen twice: a duplicate), then
    // probe it with the slots' positions: k writes and B reads, where indexing
    // the slots would take B writes and k reads (B >= k).
    for (int64_t j = 0; j < num_sel; ++j) {
      const int32_t p = sel[j];
      if (p < 0) continue;
      dup |= lane_of[p] >= 0;
      lane_of[p] = static_cast<int32_t>(j);
    }
    std::fill(held.begin(), held.end(), -1);
    std::fill(is_hit.begin(), is_hit.end(), 0);
    // Uncommitted positions (>= newest, left by a refused step) count as empty, so
    // no slot matches the newest position's lanes.
    for (int64_t s = num_slots - 1; s >= 0; --s) {  // the lowest slot wins a tie
      const int32_t p = slot_pos[base + s];
      eff[s] = (p >= newest) ? -1 : p;
      if (eff[s] < 0 || eff[s] > max_len) continue;
      const int32_t lane = lane_of[eff[s]];
      if (lane >= 0) held[lane] = static_cast<int32_t>(s);
    }
    int32_t num_miss = 0, num_valid = 0;
    for (int64_t j = 0; j < num_sel; ++j) {
      const int32_t p = sel[j];
      if (p < 0) continue;
      lane_of[p] = -1;
      if (held[j] >= 0) is_hit[held[j]] = 1;
      num_valid += 1;
      num_miss += p != newest && held[j] < 0;
    }

    // Victims: the j-th miss (selection order) takes the j-th evictable slot in
    // the victim order (LRU: the LRU order; keyed: the given order).
    int32_t num_evict = 0;
    for (int64_t i = 0; i < num_slots; ++i) {
      const int32_t s = walk[i];
      if (!is_hit[s]) {
        rank[s] = num_evict;
        by_rank[num_evict++] = s;
      }
    }
    for (int64_t s = 0; s < num_slots; ++s) taken[s] = !is_hit[s] && rank[s] < num_miss;
    // New LRU order: [evictables kept, LRU order] ++ [victims, miss order] ++ [hits].
    plan.new_lru.assign(num_slots, 0);
    int32_t kept = 0, hit_rank = 0;
    for (int64_t i = 0; i < num_slots; ++i) {
      const int32_t s = lru_row[i];
      int32_t index;
      if (is_hit[s]) {
        index = num_evict + hit_rank++;
      } else if (taken[s]) {
        index = num_evict - num_miss + rank[s];
      } else {
        index = kept++;
      }
      plan.new_lru[index] = s;  // a permutation: every index in [0, B) once
    }
    plan.new_pos.assign(eff.begin(), eff.end());
    int32_t* slot = slot_all + row * num_sel;
    bool unpaged = false;
    for (int64_t j = 0, m = 0; j < num_sel; ++j) {
      const int32_t p = sel[j];
      const bool miss = p >= 0 && p != newest && held[j] < 0;
      slot[j] = miss ? by_rank[m++]
                : held[j] >= 0 ? held[j]
                : (p >= 0 && p == newest) ? static_cast<int32_t>(num_slots) : -1;
      if (miss) plan.new_pos[slot[j]] = p;
      const int32_t page = pages[req * max_pages + LogicalPage(p, max_len, page_size,
                                                               max_pages)];
      unpaged |= miss && page < 0;
      if (miss && page >= host_pages) {
        plan.error = "a page table entry is outside the host tier";
        return;
      }
      miss_all[row * num_sel + j] = miss;  // masked by ok below
    }
    // Keyed policies' score EMA: every slot decays, a hit adds 1, a refill is 1.
    // Rounded as XLA:CPU rounds the reference's ``decay * score + hit`` (the scores
    // must be equal bit for bit): once, an FMA, where it contracts (keyed == 1, FMA
    // hosts), else twice (keyed == 2; -ffp-contract=off keeps the two apart here).
    const float* old_score = score + base;
    plan.new_score.assign(old_score, old_score + num_slots);
    if (keyed) {
      for (int64_t s = 0; s < num_slots; ++s) {
        const float hit = is_hit[s] ? 1.0f : 0.0f;
        plan.new_score[s] = taken[s] ? 1.0f
                            : keyed == 1 ? std::fma(score_decay, old_score[s], hit)
                                         : score_decay * old_score[s] + hit;
      }
    }
    // The newest token also takes the lowest-index empty slot left, most recent.
    if (on) {
      for (int64_t s = 0; s < num_slots; ++s) {
        if (plan.new_pos[s] == -1) {
          plan.target = static_cast<int32_t>(s);
          break;
        }
      }
    }
    if (plan.target >= 0) {  // (new_lru is a permutation: the target is in it)
      auto it = std::find(plan.new_lru.begin(), plan.new_lru.end(), plan.target);
      std::rotate(it, it + 1, plan.new_lru.end());
      plan.new_pos[plan.target] = newest;
      plan.new_score[plan.target] = 1.0f;
    }
    plan.hits = num_valid - num_miss;
    plan.misses = num_miss;
    plan.status = (bad ? kStatusOutOfRange : 0) | (dup ? kStatusDuplicate : 0) |
                  ((on && newest >= max_len) || (unpaged && !bad && !dup)
                       ? kStatusCapacity : 0);
    target_all[row] = plan.target;
  };
  ParallelFor(pool, rows, classify);
  int32_t layer_status = 0;
  for (const RowPlan& plan : plans) {  // the first row's error, as a serial loop
    if (plan.error != nullptr) return ffi::Error::InvalidArgument(plan.error);
    layer_status |= plan.status;
  }

  const bool ok = prior_status == 0 && layer_status == 0;
  status_out->typed_data()[0] = prior_status | layer_status;
  const int64_t head_rows = num_slots + 1;
  auto hot_row = [&](char* hot, int64_t l, int64_t row, int64_t s) {
    return hot + ((l * rows + row) * head_rows + s) * row_bytes;
  };
  const char* new_k = static_cast<const char*>(k_new.untyped_data());
  const char* new_v = static_cast<const char*>(v_new.untyped_data());
  const char* host_k_data = static_cast<const char*>(host_k.untyped_data());
  const char* host_v_data = static_cast<const char*>(host_v.untyped_data());
  std::vector<RowCopy> copies;  // the missed rows, host -> hot, copied last
  copies.reserve(2 * share * rows * num_sel);
  int64_t moved = 0;
  // Commit: slot B always; the rest only when no row (and no earlier layer) refused.
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t req = row / num_units, unit = row % num_units;
    RowPlan& plan = plans[row];
    std::memcpy(hot_row(hot_k, layer, row, num_slots), new_k + row * row_bytes, row_bytes);
    std::memcpy(hot_row(hot_v, layer, row, num_slots), new_v + row * row_bytes, row_bytes);
    bool* miss = miss_all + row * num_sel;
    if (!ok) {
      std::fill(miss, miss + num_sel, false);
      continue;
    }
    if (plan.target >= 0) {
      std::memcpy(hot_row(hot_k, layer, row, plan.target), new_k + row * row_bytes,
                  row_bytes);
      std::memcpy(hot_row(hot_v, layer, row, plan.target), new_v + row * row_bytes,
                  row_bytes);
    }
    const int32_t* sel_row = sel_all + row * num_sel;
    const int32_t* slot = slot_all + row * num_sel;
    for (int64_t j = 0; j < num_sel; ++j) {
      if (!miss[j]) continue;
      const int64_t p = sel_row[j];  // a miss: a valid position < newest <= max_len
      const int64_t pg = pages[req * max_pages + LogicalPage(p, max_len, page_size,
                                                             max_pages)];
      const int64_t host_row = ((pg * page_size + p % page_size) * num_units + unit);
      for (int64_t j2 = 0; j2 < share; ++j2) {
        const int64_t l = layer + j2;
        const int64_t from = (l * host_pages * page_size * num_units + host_row) * row_bytes;
        copies.push_back({hot_row(hot_k, l, row, slot[j]), host_k_data + from});
        copies.push_back({hot_row(hot_v, l, row, slot[j]), host_v_data + from});
      }
    }
    moved += plan.misses;
    for (int64_t j2 = 0; j2 < share; ++j2) {
      const int64_t l = layer + j2;
      if (act[req]) {
        const int64_t at = l * meta + row * num_slots;
        std::copy(plan.new_pos.begin(), plan.new_pos.end(), slot_pos + at);
        std::copy(plan.new_lru.begin(), plan.new_lru.end(), lru + at);
        std::copy(plan.new_score.begin(), plan.new_score.end(), score + at);
      }
      WrappingAdd(hits[l * rows + row], plan.hits);
      WrappingAdd(misses[l * rows + row], plan.misses);
    }
  }
  // The copies, in chunks over both cores (each chunk prefetches ahead).
  constexpr int64_t kChunk = 64;
  const int64_t num_copies = static_cast<int64_t>(copies.size());
  ParallelFor(pool, (num_copies + kChunk - 1) / kChunk, [&](int64_t chunk) {
    const int64_t at = chunk * kChunk;
    CopyRows(copies.data() + at, std::min(kChunk, num_copies - at), row_bytes);
  });
  if (ok) WrappingAdd(fetched[layer], share * moved);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvtierResolveFetch, ResolveFetchImpl,
    ffi::Ffi::Bind()
        .Arg<ffi::BufferR0<ffi::S32>>()
        .Arg<ffi::BufferR0<ffi::S32>>()
        .Arg<ffi::BufferR1<ffi::PRED>>()
        .Arg<ffi::BufferR1<ffi::S32>>()
        .Arg<ffi::BufferR3<ffi::S32>>()
        .Arg<ffi::BufferR3<ffi::S32>>()
        .Arg<ffi::BufferR2<ffi::S32>>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::Buffer<ffi::PRED>>()
        .Ret<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::Buffer<ffi::S32>>()
        .Attr<int64_t>("max_len")
        .Attr<int64_t>("page_size")
        .Attr<int64_t>("share")
        .Attr<int64_t>("keyed")
        .Attr<float>("score_decay")
        .Ctx<ffi::ThreadPool>());
