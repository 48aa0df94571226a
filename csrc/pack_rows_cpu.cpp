// pack_rows on CPU: best-fit packing of documents into BOS-aligned rows (the rule is in
// pack_rows.h), written straight into the caller's (pinned) int64 buffer.
//
// Finding "the largest document that fits" must not scan the buffer: documents are bucketed by
// length once per call (a counting sort, O(documents + row_len)), and a bitset over lengths answers
// "largest non-empty length <= space" and "smallest non-empty length > space" in row_len/64 word
// reads. Documents longer than a row can only ever be cropped, and only the shortest of them is,
// so they sit in one sorted list. Planning touches lengths only; the tokens are copied once, at the
// end, and only after the whole plan succeeded (so a failed call leaves `out` and the buffer alone).
//
// Neither entry point holds the GIL: the op is called through torch.ops (which releases it) and
// RowPacker's Python binding releases it explicitly (pack_rows_python.h).
#include <torch/library.h>

#include <algorithm>

#include "pack_rows.h"
#include "simd.h"

// The copy loops are compiled twice, for AVX2 and for the plain x86-64 the build targets (AVX2
// writes a batch of pairs in ~3/4 of the time).
#define COPY_CLONES NANOCHAT_FAST_CLONES("avx2", "default")

namespace nanochat_fast {

// ---------------------------------------------------------------------------------------------
// the planner

int64_t BestFitPlanner::largest_at_most(int64_t space) const {
  int64_t w = space >> 6;
  uint64_t word = nonempty_[w] & ((2ULL << (space & 63)) - 1);  // bits 0..space of this word
  while (true) {
    if (word) return (w << 6) + 63 - __builtin_clzll(word);
    if (--w < 0) return 0;
    word = nonempty_[w];
  }
}

int64_t BestFitPlanner::smallest_above(int64_t space) const {
  const int64_t first = space + 1;
  if (first > row_len_) return 0;
  int64_t w = first >> 6;
  const int64_t words = static_cast<int64_t>(nonempty_.size());
  uint64_t word = nonempty_[w] & (~0ULL << (first & 63));
  while (true) {
    if (word) return (w << 6) + __builtin_ctzll(word);
    if (++w >= words) return 0;
    word = nonempty_[w];
  }
}

int64_t BestFitPlanner::take(int64_t len) {
  const int64_t doc = order_[head_[len]++];
  if (head_[len] == start_[len + 1]) nonempty_[len >> 6] &= ~(1ULL << (len & 63));
  return doc;
}

int64_t BestFitPlanner::plan(const int64_t* lens, int64_t num_docs, int64_t rows, int64_t row_len,
                             std::vector<Placement>& placements, int64_t& tokens_cropped,
                             const std::vector<std::pair<int64_t, int64_t>>* row_starts) {
  row_len_ = row_len;
  placements.clear();
  tokens_cropped = 0;

  // bucket the documents by length (counting sort; ids increase within a bucket)
  start_.assign(row_len + 2, 0);
  long_docs_.clear();
  long_head_ = 0;
  for (int64_t d = 0; d < num_docs; ++d) {
    const int64_t len = lens[d];
    if (len > row_len) long_docs_.emplace_back(len, d);
    else if (len > 0) ++start_[len + 1];
  }
  for (int64_t len = 1; len <= row_len + 1; ++len) start_[len] += start_[len - 1];
  head_.assign(start_.begin(), start_.end());
  order_.resize(start_[row_len + 1]);
  for (int64_t d = 0; d < num_docs; ++d) {
    const int64_t len = lens[d];
    if (len > 0 && len <= row_len) order_[head_[len]++] = d;
  }
  head_.assign(start_.begin(), start_.end());
  nonempty_.assign((row_len >> 6) + 1, 0);
  for (int64_t len = 1; len <= row_len; ++len)
    if (start_[len + 1] > start_[len]) nonempty_[len >> 6] |= 1ULL << (len & 63);
  std::sort(long_docs_.begin(), long_docs_.end());  // by length, then id

  for (int64_t row = 0; row < rows; ++row) {
    int64_t pos = 0;
    if (row_starts != nullptr && row < static_cast<int64_t>(row_starts->size())) {
      const auto [doc, len] = (*row_starts)[row];
      placements.push_back({row, doc, 0, len});
      pos = len;
    }
    while (pos < row_len) {
      const int64_t space = row_len - pos;
      const int64_t fit = largest_at_most(space);
      if (fit > 0) {
        placements.push_back({row, take(fit), pos, fit});
        pos += fit;
        continue;
      }
      // nothing fits: crop the shortest document left (all of them are longer than `space`)
      int64_t doc, len;
      const int64_t shortest = smallest_above(space);
      if (shortest > 0) {
        len = shortest;
        doc = take(shortest);
      } else if (long_head_ < long_docs_.size()) {
        len = long_docs_[long_head_].first;
        doc = long_docs_[long_head_++].second;
      } else {
        // out of documents: keep only the rows that were completed
        while (!placements.empty() && placements.back().row == row) placements.pop_back();
        return row;
      }
      placements.push_back({row, doc, pos, space});
      tokens_cropped += len - space;
      pos = row_len;
    }
  }
  return rows;
}

namespace {

// A token as the packer writes it: widened through int32 (what a token id is), with `flag` OR-ed
// in where the document's mask is set.
template <typename src_t>
inline int64_t token_at(const src_t* src, const uint8_t* mask, int64_t flag, int64_t i) {
  const int64_t v = static_cast<int32_t>(src[i]);
  return mask == nullptr ? v : v | (flag & -static_cast<int64_t>(mask[i] != 0));
}

// One piece (the first n tokens of a document) into its place in a row.
template <typename src_t>
COPY_CLONES void write_piece(const src_t* __restrict__ src, const uint8_t* __restrict__ mask, int64_t flag,
                             int64_t n, int64_t* __restrict__ dst) {
  if (mask == nullptr) {
    for (int64_t i = 0; i < n; ++i) dst[i] = token_at<src_t>(src, nullptr, 0, i);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = token_at(src, mask, flag, i);
  }
}

void check_out(const at::Tensor& out, const char* who) {
  TORCH_CHECK_VALUE(out.device().is_cpu(), who, ": out must be a CPU tensor (pinned memory is fine), got ",
                    out.device());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kLong, who, ": out must be int64, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.dim() == 2, who, ": out must be 2-D [rows, T+1], got ", out.dim(), "-D");
  TORCH_CHECK_VALUE(out.is_contiguous(), who, ": out must be contiguous (a row-major [rows, T+1] buffer)");
  TORCH_CHECK_VALUE(out.size(1) >= 2, who, ": out must have T+1 >= 2 columns, got ", out.size(1));
}

// ---------------------------------------------------------------------------------------------
// the stateless op

// The counts are SymInts in the schema so that the fake kernel can return unbacked sizes under
// tracing; here they are plain values.
std::tuple<at::Tensor, c10::SymInt, c10::SymInt> pack_rows_cpu(const at::Tensor& tokens, const at::Tensor& offsets,
                                                               const at::Tensor& out, int64_t bos_id) {
  TORCH_CHECK_VALUE(tokens.device().is_cpu() && offsets.device().is_cpu(),
                    "pack_rows: tokens and offsets must be CPU tensors");
  TORCH_CHECK_VALUE(tokens.scalar_type() == at::kInt && tokens.dim() == 1 && tokens.is_contiguous(),
                    "pack_rows: tokens must be a contiguous 1-D int32 tensor, got ", tokens.scalar_type(),
                    " with shape ", tokens.sizes());
  TORCH_CHECK_VALUE(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() &&
                        offsets.numel() >= 1,
                    "pack_rows: offsets must be a contiguous 1-D int64 tensor of D+1 >= 1 entries, got ",
                    offsets.scalar_type(), " with shape ", offsets.sizes());
  check_out(out, "pack_rows");
  TORCH_CHECK_VALUE(bos_id >= 0, "pack_rows: bos_id must be >= 0, got ", bos_id);

  const int64_t num_docs = offsets.numel() - 1, n = tokens.numel();
  const int64_t rows = out.size(0), row_len = out.size(1);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int32_t* tok = tokens.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(off[0] == 0 && off[num_docs] == n, "pack_rows: offsets must start at 0 and end at "
                    "tokens.numel() = ", n, ", got ", off[0], " and ", off[num_docs]);
  std::vector<int64_t> lens(num_docs);
  std::vector<const int32_t*> docs(num_docs);
  for (int64_t d = 0; d < num_docs; ++d) {
    lens[d] = off[d + 1] - off[d];
    TORCH_CHECK_VALUE(lens[d] > 0, "pack_rows: document ", d, " is empty (offsets must increase strictly)");
    TORCH_CHECK_VALUE(tok[off[d]] == bos_id, "pack_rows: document ", d, " starts with token ", tok[off[d]],
                      ", not bos_id=", bos_id, " (documents must begin with <|bos|>)");
    docs[d] = tok + off[d];
  }

  BestFitPlanner planner;
  std::vector<Placement> placements;
  int64_t cropped = 0;
  const int64_t done = planner.plan(lens.data(), num_docs, rows, row_len, placements, cropped);
  TORCH_CHECK_VALUE(done == rows, "pack_rows: the ", num_docs, " documents (", n, " tokens) ran out after ",
                    done, " of ", rows, " rows of ", row_len, " tokens; pass more documents");

  at::Tensor used = at::zeros({num_docs}, tokens.options().dtype(at::kBool));
  bool* u = used.data_ptr<bool>();
  for (const Placement& p : placements) u[p.doc] = true;
  int64_t* dst = out.data_ptr<int64_t>();
  for (const Placement& p : placements) write_piece(docs[p.doc], nullptr, 0, p.len, dst + p.row * row_len + p.pos);
  return {used, c10::SymInt(rows * row_len), c10::SymInt(cropped)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// the stateful packer

RowPacker::RowPacker(int64_t row_len, int64_t bos_id) : row_len_(row_len), bos_id_(bos_id) {
  TORCH_CHECK_VALUE(row_len >= 2, "RowPacker: row_len (T+1) must be >= 2, got ", row_len);
  TORCH_CHECK_VALUE(bos_id >= 0, "RowPacker: bos_id must be >= 0, got ", bos_id);
}

int32_t RowPacker::new_source(const at::Tensor& tokens, const std::optional<at::Tensor>& mask) {
  int32_t s;
  if (!free_sources_.empty()) {
    s = free_sources_.back();
    free_sources_.pop_back();
  } else {
    s = static_cast<int32_t>(sources_.size());
    sources_.emplace_back();
  }
  sources_[s].tokens = tokens;
  sources_[s].mask = mask;
  sources_[s].live = 0;
  return s;
}

void RowPacker::release(int32_t source) {
  Source& s = sources_[source];
  if (--s.live == 0) {
    s.tokens = at::Tensor();
    s.mask.reset();
    free_sources_.push_back(source);
  }
}

template <typename src_t>
void RowPacker::add_typed(const src_t* tokens, const int64_t* offsets, int64_t n_docs, int64_t first_id,
                          const uint8_t* mask, int64_t mask_bit, Dtype dtype, int32_t source) {
  const int64_t flag = mask != nullptr ? int64_t{1} << mask_bit : 0;
  for (int64_t j = 0; j < n_docs; ++j) {
    const int64_t b = offsets[j], full_len = offsets[j + 1] - b, len = std::min(full_len, row_len_);
    docs_.push_back({tokens + b, mask != nullptr ? mask + b : nullptr, flag, full_len, source, dtype,
                     static_cast<int8_t>(sizeof(src_t))});
    ids_.push_back(first_id + j);
    lens_.push_back(len);
    mass_ += len;
  }
  sources_[source].live += n_docs;
}

void RowPacker::add(const at::Tensor& tokens, const at::Tensor& offsets, int64_t first_id,
                    const std::optional<at::Tensor>& mask, int64_t mask_bit) {
  TORCH_CHECK_VALUE(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                        offsets.is_contiguous() && offsets.numel() >= 1,
                    "RowPacker.add: offsets must be a contiguous 1-D int64 CPU tensor with >= 1 entry");
  add_docs(tokens, offsets.data_ptr<int64_t>(), offsets.numel() - 1, first_id, mask, mask_bit);
}

void RowPacker::add_docs(const at::Tensor& tokens, const int64_t* off, int64_t docs, int64_t first_id,
                         const std::optional<at::Tensor>& mask, int64_t mask_bit) {
  TORCH_CHECK_VALUE(tokens.device().is_cpu() && tokens.dim() == 1 && tokens.is_contiguous(),
                    "RowPacker.add: tokens must be a contiguous 1-D CPU tensor");
  const auto type = tokens.scalar_type();
  TORCH_CHECK_VALUE(type == at::kInt || type == at::kUInt16 || type == at::kUInt32,
                    "RowPacker.add: tokens must be int32, uint16 or uint32, got ", type);
  const uint8_t* m = nullptr;
  if (mask) {
    TORCH_CHECK_VALUE(mask->device().is_cpu() && mask->is_contiguous() && mask->numel() == tokens.numel() &&
                          (mask->scalar_type() == at::kByte || mask->scalar_type() == at::kBool),
                      "RowPacker.add: mask must be a contiguous uint8 or bool CPU tensor with one entry per token");
    TORCH_CHECK_VALUE(mask_bit >= 0 && mask_bit < 31, "RowPacker.add: mask_bit must be in [0, 31) with a mask, got ",
                      mask_bit);
    m = static_cast<const uint8_t*>(mask->data_ptr());
  }
  const int64_t n = tokens.numel();
  // check everything first: a rejected call adds nothing
  for (int64_t j = 0; j <= docs; ++j)
    TORCH_CHECK_VALUE(off[j] >= 0 && off[j] <= n && (j == 0 || off[j] > off[j - 1]),
                      "RowPacker.add: offsets must increase strictly and stay within the ", n,
                      " tokens (document ", j - 1, ")");
  const void* data = tokens.data_ptr();
  for (int64_t j = 0; j < docs; ++j) {
    const int64_t first = type == at::kInt      ? static_cast<const int32_t*>(data)[off[j]]
                          : type == at::kUInt16 ? static_cast<const uint16_t*>(data)[off[j]]
                                                : static_cast<const uint32_t*>(data)[off[j]];
    TORCH_CHECK_VALUE(first == bos_id_, "RowPacker.add: document ", first_id + j, " starts with token ", first,
                      ", not bos_id=", bos_id_);
  }
  if (docs == 0) return;
  const int32_t source = new_source(tokens, m != nullptr ? mask : std::nullopt);
  if (type == at::kInt)
    add_typed(tokens.data_ptr<int32_t>(), off, docs, first_id, m, mask_bit, Dtype::kInt32, source);
  else if (type == at::kUInt16)
    add_typed(tokens.data_ptr<uint16_t>(), off, docs, first_id, m, mask_bit, Dtype::kUInt16, source);
  else
    add_typed(tokens.data_ptr<uint32_t>(), off, docs, first_id, m, mask_bit, Dtype::kUInt32, source);
}

namespace {

// One piece placed at row position `pos` written as training pairs: token i is an input at pos + i
// (if < T) and the target one position before (if >= 1), so a row's first token is no target and
// its last no input. With mask_bit >= 0 the flag bit is dropped and an unflagged target is -1.
template <typename src_t>
COPY_CLONES void write_pair_piece(const src_t* __restrict__ src, const uint8_t* __restrict__ mask,
                                  int64_t flag, int64_t n, int64_t pos, int64_t T, int64_t* __restrict__ in,
                                  int64_t* __restrict__ tg, int mask_bit) {
  const int64_t n_in = std::min(n, T - pos), skip = pos == 0 ? 1 : 0, n_tg = n - skip;
  in += pos;
  tg += pos + skip - 1;  // target of token skip + i
  if (mask_bit < 0) {
    if (mask == nullptr) {  // the common case: plain widening copies
      for (int64_t i = 0; i < n_in; ++i) in[i] = static_cast<int32_t>(src[i]);
      for (int64_t i = 0; i < n_tg; ++i) tg[i] = static_cast<int32_t>(src[skip + i]);
    } else {
      for (int64_t i = 0; i < n_in; ++i) in[i] = token_at(src, mask, flag, i);
      for (int64_t i = 0; i < n_tg; ++i) tg[i] = token_at(src, mask, flag, skip + i);
    }
    return;
  }
  const int64_t keep = ~(int64_t{1} << mask_bit);
  for (int64_t i = 0; i < n_in; ++i) in[i] = token_at(src, mask, flag, i) & keep;
  for (int64_t i = 0; i < n_tg; ++i) {
    // a flagged target keeps its token, any other becomes -1 (OR-ed with all ones)
    const int64_t v = token_at(src, mask, flag, skip + i);
    tg[i] = (v & keep) | (static_cast<int64_t>((static_cast<uint64_t>(v) >> mask_bit) & 1) - 1);
  }
}

}  // namespace

template <typename Fn>
void RowPacker::with_source(const Doc& doc, Fn&& fn) {
  switch (doc.dtype) {
    case Dtype::kInt32: fn(static_cast<const int32_t*>(doc.tokens)); break;
    case Dtype::kUInt16: fn(static_cast<const uint16_t*>(doc.tokens)); break;
    case Dtype::kUInt32: fn(static_cast<const uint32_t*>(doc.tokens)); break;
  }
}

std::tuple<int64_t, int64_t, int64_t> RowPacker::pack(const at::Tensor& out, int64_t total_rows, int64_t first_row,
                                                      int64_t due_before, const std::optional<at::Tensor>& targets,
                                                      int64_t mask_bit) {
  const int64_t width = targets ? row_len_ - 1 : row_len_;
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 2 && out.is_contiguous() &&
                        out.size(1) == width,
                    "RowPacker.pack: out must be a contiguous int64 CPU tensor [rows, ", width, "], got ",
                    out.scalar_type(), " ", out.sizes());
  if (targets) {
    TORCH_CHECK_VALUE(targets->device().is_cpu() && targets->scalar_type() == at::kLong && targets->is_contiguous() &&
                          targets->sizes() == out.sizes(),
                      "RowPacker.pack: targets must be a contiguous int64 CPU tensor shaped like out");
    TORCH_CHECK_VALUE(mask_bit >= -1 && mask_bit < 31, "RowPacker.pack: mask_bit must be in [-1, 31), got ", mask_bit);
  }
  TORCH_CHECK_VALUE(first_row >= 0 && first_row + out.size(0) <= total_rows, "RowPacker.pack: rows [", first_row,
                    ", ", first_row + out.size(0), ") are not within total_rows=", total_rows);
  const int64_t n = num_docs(), num_out = out.size(0);
  // the oldest due documents start the rows; best-fit sees the others
  due_.clear();
  for (int64_t d = 0; d < n; ++d)
    if (ids_[d] < due_before) due_.emplace_back(ids_[d], d);
  std::sort(due_.begin(), due_.end());
  if (static_cast<int64_t>(due_.size()) > total_rows) due_.resize(total_rows);
  plan_lens_.assign(lens_.begin(), lens_.end());
  row_starts_.clear();
  for (const auto& [id, d] : due_) {
    row_starts_.emplace_back(d, lens_[d]);
    plan_lens_[d] = 0;
  }
  int64_t cropped = 0;
  const int64_t done = planner_.plan(plan_lens_.data(), n, total_rows, row_len_, placements_, cropped, &row_starts_);
  TORCH_CHECK_VALUE(done == total_rows, "RowPacker.pack: the ", n, " buffered documents ran out after ", done,
                    " of ", total_rows, " rows of ", row_len_, " tokens; add more documents");

  // The documents come straight from the caller's memory (for the loader: shard pages that are
  // rarely still in a cache), one short run each, so the hardware prefetcher barely gets going.
  // Fetching the pieces a few KiB ahead of the one being written overlaps their misses.
  const int64_t last_row = first_row + num_out;
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* tg = targets ? targets->data_ptr<int64_t>() : nullptr;
  const int64_t T = row_len_ - 1;
  constexpr int64_t kPrefetchBytes = 4096;  // docs/measurements.md#token-packing
  const size_t count = placements_.size();
  size_t ahead = 0;         // the next placement to prefetch
  int64_t ahead_bytes = 0;  // bytes prefetched and not yet written
  for (size_t k = 0; k < count; ++k) {
    const Placement& p = placements_[k];
    if (p.row < first_row || p.row >= last_row) continue;
    const Doc& doc = docs_[p.doc];
    if (k < ahead) ahead_bytes -= p.len * doc.token_size;  // prefetched, now written
    for (ahead = std::max(ahead, k + 1); ahead < count && ahead_bytes < kPrefetchBytes; ++ahead) {
      const Placement& q = placements_[ahead];
      if (q.row < first_row || q.row >= last_row) continue;
      const Doc& next = docs_[q.doc];
      const char* bytes = static_cast<const char*>(next.tokens);
      const int64_t size = q.len * next.token_size;
      for (int64_t b = 0; b < size; b += 64) __builtin_prefetch(bytes + b);
      if (next.mask != nullptr)
        for (int64_t b = 0; b < q.len; b += 64) __builtin_prefetch(next.mask + b);
      ahead_bytes += size;
    }
    const int64_t r = p.row - first_row;
    with_source(doc, [&](auto src) {
      if (tg == nullptr)
        write_piece(src, doc.mask, doc.flag, p.len, o + r * row_len_ + p.pos);
      else
        write_pair_piece(src, doc.mask, doc.flag, p.len, p.pos, T, o + r * T, tg + r * T, static_cast<int>(mask_bit));
    });
  }

  // remove the used documents, keeping the others in order
  used_.assign(n, 0);
  for (const Placement& p : placements_) {
    used_[p.doc] = 1;
    mass_ -= lens_[p.doc];
    cropped += docs_[p.doc].full_len - lens_[p.doc];  // the tail beyond a row's length
    release(docs_[p.doc].source);
  }
  int64_t kept = 0;
  for (int64_t d = 0; d < n; ++d) {
    if (used_[d]) continue;
    if (kept != d) {
      docs_[kept] = docs_[d];
      ids_[kept] = ids_[d];
      lens_[kept] = lens_[d];
    }
    ++kept;
  }
  docs_.resize(kept);
  ids_.resize(kept);
  lens_.resize(kept);
  return {n - kept, total_rows * row_len_, cropped};
}

at::Tensor RowPacker::ids() const {
  return at::tensor(ids_, at::TensorOptions().dtype(at::kLong));
}

at::Tensor RowPacker::lengths() const {
  return at::tensor(lens_, at::TensorOptions().dtype(at::kLong));
}

void RowPacker::clear() {
  docs_.clear();
  ids_.clear();
  lens_.clear();
  sources_.clear();
  free_sources_.clear();
  mass_ = 0;
}

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) {
  m.impl("pack_rows", &pack_rows_cpu);
}

}  // namespace nanochat_fast
