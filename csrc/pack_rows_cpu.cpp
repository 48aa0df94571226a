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

template <typename token_t>
void write_rows(const std::vector<Placement>& placements, const token_t* const* docs, int64_t* out,
                int64_t row_len, int64_t first_row, int64_t num_out_rows) {
  for (const Placement& p : placements) {
    const int64_t r = p.row - first_row;
    if (r < 0 || r >= num_out_rows) continue;
    const token_t* __restrict__ src = docs[p.doc];
    int64_t* __restrict__ dst = out + r * row_len + p.pos;
    for (int64_t i = 0; i < p.len; ++i) dst[i] = static_cast<int64_t>(src[i]);  // widening, vectorised
  }
}

template void write_rows<int32_t>(const std::vector<Placement>&, const int32_t* const*, int64_t*,
                                  int64_t, int64_t, int64_t);

template <typename token_t>
void write_split_rows(const std::vector<Placement>& placements, const token_t* const* docs, int64_t* inputs,
                      int64_t* targets, int64_t row_len, int64_t first_row, int64_t num_out_rows, int mask_bit) {
  const int64_t T = row_len - 1;
  const int64_t flag = mask_bit >= 0 ? int64_t{1} << mask_bit : 0, keep = ~flag;
  for (const Placement& p : placements) {
    const int64_t r = p.row - first_row;
    if (r < 0 || r >= num_out_rows) continue;
    // token i of the piece sits at row position p.pos + i: it is an input there (if < T) and the
    // target one position before (if >= 1), so a row's first token is no target and its last no input
    const token_t* __restrict__ src = docs[p.doc];
    int64_t* __restrict__ in = inputs + r * T + p.pos;
    const int64_t n_in = std::min(p.len, T - p.pos), skip = p.pos == 0 ? 1 : 0, n_tg = p.len - skip;
    const token_t* __restrict__ tsrc = src + skip;
    int64_t* __restrict__ tg = targets + r * T + p.pos + skip - 1;
    if (mask_bit < 0) {
      for (int64_t i = 0; i < n_in; ++i) in[i] = static_cast<int64_t>(src[i]);
      for (int64_t i = 0; i < n_tg; ++i) tg[i] = static_cast<int64_t>(tsrc[i]);
    } else {
      for (int64_t i = 0; i < n_in; ++i) in[i] = static_cast<int64_t>(src[i]) & keep;
      for (int64_t i = 0; i < n_tg; ++i) {
        const int64_t v = static_cast<int64_t>(tsrc[i]);
        tg[i] = (v & flag) ? (v & keep) : -1;
      }
    }
  }
}

namespace {

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
  write_rows(placements, docs.data(), out.data_ptr<int64_t>(), row_len, 0, rows);
  return {used, c10::SymInt(rows * row_len), c10::SymInt(cropped)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// the stateful packer

RowPacker::RowPacker(int64_t row_len, int64_t bos_id) : row_len_(row_len), bos_id_(bos_id) {
  TORCH_CHECK_VALUE(row_len >= 2, "RowPacker: row_len (T+1) must be >= 2, got ", row_len);
  TORCH_CHECK_VALUE(bos_id >= 0, "RowPacker: bos_id must be >= 0, got ", bos_id);
}

template <typename src_t>
void RowPacker::add_typed(const src_t* tokens, int64_t n_tokens, const int64_t* offsets, int64_t n_docs,
                          int64_t first_id, const uint8_t* mask, int64_t mask_bit) {
  // check everything first: a rejected call adds nothing
  for (int64_t j = 0; j <= n_docs; ++j)
    TORCH_CHECK_VALUE(offsets[j] >= 0 && offsets[j] <= n_tokens && (j == 0 || offsets[j] > offsets[j - 1]),
                      "RowPacker.add: offsets must increase strictly and stay within the ", n_tokens,
                      " tokens (document ", j - 1, ")");
  for (int64_t j = 0; j < n_docs; ++j)
    TORCH_CHECK_VALUE(static_cast<int64_t>(tokens[offsets[j]]) == bos_id_, "RowPacker.add: document ",
                      first_id + j, " starts with token ", static_cast<int64_t>(tokens[offsets[j]]),
                      ", not bos_id=", bos_id_);
  const int32_t flag = mask != nullptr ? int32_t{1} << mask_bit : 0;
  for (int64_t j = 0; j < n_docs; ++j) {
    const int64_t b = offsets[j], full_len = offsets[j + 1] - b, len = std::min(full_len, row_len_);
    std::vector<int32_t> dst;
    if (!spare_.empty()) {
      dst = std::move(spare_.back());
      spare_.pop_back();
    }
    dst.resize(len);
    if (mask != nullptr) {
      for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<int32_t>(tokens[b + i]) | (mask[b + i] ? flag : 0);
    } else {
      for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<int32_t>(tokens[b + i]);
    }
    docs_.push_back(std::move(dst));
    ids_.push_back(first_id + j);
    lens_.push_back(len);
    full_lens_.push_back(full_len);
    mass_ += len;
  }
}

void RowPacker::add(const at::Tensor& tokens, const at::Tensor& offsets, int64_t first_id,
                    const std::optional<at::Tensor>& mask, int64_t mask_bit) {
  TORCH_CHECK_VALUE(tokens.device().is_cpu() && tokens.dim() == 1 && tokens.is_contiguous(),
                    "RowPacker.add: tokens must be a contiguous 1-D CPU tensor");
  TORCH_CHECK_VALUE(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                        offsets.is_contiguous() && offsets.numel() >= 1,
                    "RowPacker.add: offsets must be a contiguous 1-D int64 CPU tensor with >= 1 entry");
  const uint8_t* m = nullptr;
  if (mask) {
    TORCH_CHECK_VALUE(mask->device().is_cpu() && mask->is_contiguous() && mask->numel() == tokens.numel() &&
                          (mask->scalar_type() == at::kByte || mask->scalar_type() == at::kBool),
                      "RowPacker.add: mask must be a contiguous uint8 or bool CPU tensor with one entry per token");
    TORCH_CHECK_VALUE(mask_bit >= 0 && mask_bit < 31, "RowPacker.add: mask_bit must be in [0, 31) with a mask, got ",
                      mask_bit);
    m = static_cast<const uint8_t*>(mask->data_ptr());
  }
  const int64_t n = tokens.numel(), docs = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  switch (tokens.scalar_type()) {
    case at::kInt: add_typed(tokens.data_ptr<int32_t>(), n, off, docs, first_id, m, mask_bit); break;
    case at::kUInt16: add_typed(tokens.data_ptr<uint16_t>(), n, off, docs, first_id, m, mask_bit); break;
    case at::kUInt32: add_typed(tokens.data_ptr<uint32_t>(), n, off, docs, first_id, m, mask_bit); break;
    default:
      TORCH_CHECK_VALUE(false, "RowPacker.add: tokens must be int32, uint16 or uint32, got ", tokens.scalar_type());
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
  const int64_t n = num_docs();
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
  doc_ptrs_.resize(n);
  for (int64_t d = 0; d < n; ++d) doc_ptrs_[d] = docs_[d].data();
  if (targets)
    write_split_rows(placements_, doc_ptrs_.data(), out.data_ptr<int64_t>(), targets->data_ptr<int64_t>(), row_len_,
                     first_row, out.size(0), static_cast<int>(mask_bit));
  else
    write_rows(placements_, doc_ptrs_.data(), out.data_ptr<int64_t>(), row_len_, first_row, out.size(0));

  // remove the used documents, keeping the others in order (their token vectors are reused)
  used_.assign(n, 0);
  for (const Placement& p : placements_) {
    used_[p.doc] = 1;
    mass_ -= lens_[p.doc];
    cropped += full_lens_[p.doc] - lens_[p.doc];  // the tail cut off when it was added
  }
  int64_t kept = 0;
  for (int64_t d = 0; d < n; ++d) {
    if (used_[d]) {
      spare_.push_back(std::move(docs_[d]));
      continue;
    }
    if (kept != d) {
      docs_[kept] = std::move(docs_[d]);
      ids_[kept] = ids_[d];
      lens_[kept] = lens_[d];
      full_lens_[kept] = full_lens_[d];
    }
    ++kept;
  }
  docs_.resize(kept);
  ids_.resize(kept);
  lens_.resize(kept);
  full_lens_.resize(kept);
  return {n - kept, total_rows * row_len_, cropped};
}

at::Tensor RowPacker::ids() const {
  return at::tensor(ids_, at::TensorOptions().dtype(at::kLong));
}

at::Tensor RowPacker::lengths() const {
  return at::tensor(lens_, at::TensorOptions().dtype(at::kLong));
}

void RowPacker::clear() {
  for (auto& d : docs_) spare_.push_back(std::move(d));
  docs_.clear();
  ids_.clear();
  lens_.clear();
  full_lens_.clear();
  mass_ = 0;
}

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) {
  m.impl("pack_rows", &pack_rows_cpu);
}

}  // namespace nanochat_fast
