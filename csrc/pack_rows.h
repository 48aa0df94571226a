// Best-fit packing of BOS-started documents into rows of `row_len` tokens (row_len = T + 1: the
// inputs are a row's first T tokens, the targets its last T).
//
// The rule (the same as nanochat_fast/kernels/pack_rows.py's plain-Python reference): rows are
// filled in order; into each row, repeatedly place the largest unused document that fits the space
// left (ties: lowest index); when none fits, crop the shortest unused document (ties: lowest index)
// to fill the row exactly and discard its rest. Every row therefore starts with a document's first
// token, its <|bos|>.
//
// Two entry points share the planner: the stateless op pack_rows (pack_rows_cpu.cpp) and
// RowPacker, which keeps the document buffer on the C++ side between calls so that a data loader
// only hands over the new documents (RowStream, pack_rows_stream.h, is that loader's per-batch work;
// both are bound to Python in pack_rows_python.h). None of them needs Python.
#pragma once
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace nanochat_fast {

// "Place the first `len` tokens of document `doc` at out[row, pos:pos+len]".
struct Placement {
  int64_t row, doc, pos, len;
};

// Decides where every document goes; owns its scratch space, so a long-lived planner allocates
// nothing per call. A document of length 0 is left out (RowPacker's due documents, placed apart).
class BestFitPlanner {
 public:
  // Plans `rows` rows. Returns the number of rows completed: `rows` on success, fewer when the
  // documents ran out (then `placements` holds only the completed rows' placements).
  // With `row_starts`, row r < row_starts->size() begins with document (*row_starts)[r].first of
  // length .second (<= row_len; its entry in `lens` must be 0) before best-fit fills the rest.
  int64_t plan(const int64_t* lens, int64_t num_docs, int64_t rows, int64_t row_len,
               std::vector<Placement>& placements, int64_t& tokens_cropped,
               const std::vector<std::pair<int64_t, int64_t>>* row_starts = nullptr);

 private:
  int64_t largest_at_most(int64_t space) const;   // a non-empty length bucket <= space, or 0
  int64_t smallest_above(int64_t space) const;    // a non-empty length bucket in (space, row_len], or 0
  int64_t take(int64_t len);                      // pops the lowest-index document of that length

  int64_t row_len_ = 0;
  std::vector<int64_t> start_, head_;  // per length 1..row_len: bucket [head_, start_[len+1]) in order_
  std::vector<int64_t> order_;         // document ids, grouped by length, increasing id in a group
  std::vector<uint64_t> nonempty_;     // bit `len`: bucket `len` still has documents
  std::vector<std::pair<int64_t, int64_t>> long_docs_;  // (len, id) of documents longer than a row
  size_t long_head_ = 0;
};

// A document buffer that lives across calls, in arrival order: add() appends documents (each with
// a caller-chosen id, e.g. its position in the data stream), pack() applies the rule above to the
// buffered documents in that order (ties go to the oldest) and removes the ones it used.
//
// Best-fit alone can keep a document waiting for good: one of an awkward length is never the
// largest that fits while better-fitting documents keep arriving (docs/measurements.md#packing-due-documents).
// So pack() takes
// `due_before`: documents with an id below it are due, and the oldest of them (one per row, at
// most total_rows) start the rows, in id order, before best-fit fills the rest. A loader that uses
// stream positions as ids bounds every document's wait that way.
//
// The buffer counts at most row_len tokens of a document. The rest could never be placed anyway (a
// row starts with a document's first token), and cut to a row's length a long document can fill a
// whole row. Counted whole, it would never fit, and as only the shortest of such documents is ever
// cropped, the longest would wait in the buffer for good. The cut-off tails count as cropped.
//
// The buffer holds no tokens: add() keeps a reference to the caller's tensors (the loader's are
// the memory-mapped token shards) and pack() reads each placed document from there, once. So the
// tensors must not change while documents of theirs are buffered. (Copying the documents in took
// a sixth of the loader's time.)
class RowPacker {
 public:
  RowPacker(int64_t row_len, int64_t bos_id);

  // Appends documents tokens[offsets[j]:offsets[j+1]] for j < offsets.numel()-1, with ids
  // first_id+j. tokens: 1-D int32, uint16 or uint32 CPU tensor; offsets: increasing int64 into
  // tokens. With `mask` (uint8 or bool, one per token) and mask_bit >= 0, a token whose mask is
  // set is written with bit mask_bit set (its "supervised" flag; see pack()).
  void add(const at::Tensor& tokens, const at::Tensor& offsets, int64_t first_id,
           const std::optional<at::Tensor>& mask = std::nullopt, int64_t mask_bit = -1);
  // The same with the offsets as a pointer to docs + 1 entries (RowStream adds runs of a shard).
  void add_docs(const at::Tensor& tokens, const int64_t* offsets, int64_t docs, int64_t first_id,
                const std::optional<at::Tensor>& mask = std::nullopt, int64_t mask_bit = -1);

  // Plans `total_rows` rows over the buffered documents and writes rows [first_row, first_row +
  // out.size(0)) into out (int64 [R, row_len], contiguous, CPU); or, given `targets`, writes them
  // as training pairs: out = inputs = row[:-1] and targets = row[1:] (both [R, row_len - 1]); with
  // mask_bit >= 0 a token's bit mask_bit is its "supervised" flag, dropped from the written token,
  // and a target without it becomes -1. Returns (documents used, tokens placed, tokens cropped)
  // over all `total_rows` rows. Throws, leaving the buffer unchanged, when the documents run out.
  std::tuple<int64_t, int64_t, int64_t> pack(const at::Tensor& out, int64_t total_rows, int64_t first_row,
                                             int64_t due_before = INT64_MIN,
                                             const std::optional<at::Tensor>& targets = std::nullopt,
                                             int64_t mask_bit = -1);

  int64_t num_docs() const { return static_cast<int64_t>(docs_.size()); }
  int64_t mass() const { return mass_; }  // tokens buffered: sum of min(length, row_len)
  int64_t row_len() const { return row_len_; }
  int64_t bos_id() const { return bos_id_; }
  at::Tensor ids() const;      // int64[num_docs], in buffer order
  at::Tensor lengths() const;  // int64[num_docs]: tokens kept (<= row_len)
  void clear();

 private:
  enum class Dtype : int8_t { kInt32, kUInt16, kUInt32 };
  struct Doc {  // where a buffered document is (its id and kept length are in ids_ and lens_)
    const void* tokens;    // the document's first token, in its source tensor
    const uint8_t* mask;   // its mask, or nullptr
    int64_t flag;          // OR-ed into a token whose mask is set
    int64_t full_len;      // the document's length
    int32_t source;        // index into sources_
    Dtype dtype;
    int8_t token_size;     // bytes
  };
  struct Source {  // the tensors of one add() call, kept alive while documents of theirs are buffered
    at::Tensor tokens;
    std::optional<at::Tensor> mask;
    int64_t live = 0;  // buffered documents that point into it
  };
  template <typename src_t>
  void add_typed(const src_t* tokens, const int64_t* offsets, int64_t n_docs, int64_t first_id,
                 const uint8_t* mask, int64_t mask_bit, Dtype dtype, int32_t source);
  int32_t new_source(const at::Tensor& tokens, const std::optional<at::Tensor>& mask);
  void release(int32_t source);
  template <typename Fn>
  static void with_source(const Doc& doc, Fn&& fn);  // fn(tokens pointer of the document's type)

  int64_t row_len_, bos_id_;
  std::vector<Doc> docs_;
  std::vector<int64_t> ids_, lens_;  // per buffered document: its id, tokens kept (<= row_len)
  std::vector<Source> sources_;
  std::vector<int32_t> free_sources_;
  int64_t mass_ = 0;
  BestFitPlanner planner_;
  std::vector<Placement> placements_;
  std::vector<int64_t> plan_lens_;
  std::vector<std::pair<int64_t, int64_t>> due_, row_starts_;
  std::vector<char> used_;
};

}  // namespace nanochat_fast
