// RowStream: a data loader's whole per-batch work (pack a global batch with RowPacker, refill its
// buffer from the data stream, snapshot the state) in one call, and a thread that runs it ahead.
//
// It is the compiled twin of nanochat_fast/dataloader.py's RowStream, which says what the stream
// is: the documents of one split in a fixed order (`epoch`: runs of documents, tokens[offsets[j]:
// offsets[j+1]], the memory-mapped token shards with any extra documents interleaved), repeated
// for ever; position p of the stream is document p % n_docs, and it is the document's id in the
// packer. Both must give the same batches and states (python_tests/test_dataloader.py).
//
// Why in C++: packing a batch takes ~50-60 us, and a Python prefetch thread around it cost as much
// again, in handing the GIL back and forth with the training loop. The thread here never takes
// the GIL: the training loop's get() waits (GIL released) on a condition variable, and that is all
// the two threads share. Everything the thread touches belongs to this object, and the Python
// binding allows no other call while it runs.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "pack_rows.h"

namespace nanochat_fast {

// Documents tokens[offsets[j]:offsets[j+1]] for j < offsets.numel() - 1 (offsets index `tokens`),
// with an optional per-token mask (see RowPacker::add).
struct DocRun {
  at::Tensor tokens, offsets;
  std::optional<at::Tensor> mask;
};

// Memory for a stream's batches: blocks of one size, handed out as tensors and taken back when
// torch frees them. A training loop holds a few batches at a time (a step's micro-batches), and
// the C library's malloc returns such large blocks to the system once they are freed, so fresh
// tensors would cost a page fault every 4 KiB (docs/measurements.md#token-packing).
class BlockPool : public std::enable_shared_from_this<BlockPool> {
 public:
  explicit BlockPool(size_t bytes);
  ~BlockPool();
  at::Tensor int64_tensor(at::IntArrayRef sizes);  // sizes must hold `bytes` bytes of int64
  size_t bytes() const { return bytes_; }

 private:
  void give_back(void* block);
  size_t bytes_, max_free_;
  std::mutex mutex_;
  std::vector<void*> free_;
};

class RowStream {
 public:
  // The state after a batch: the stream position of the next document to read, the positions of
  // the documents waiting in the buffer (in buffer order), and running totals.
  struct State {
    int64_t next_pos = 0;
    at::Tensor buffer;
    int64_t batches = 0, tokens_used = 0, tokens_cropped = 0;
  };
  // This rank's part of a batch: rows [R, row_len], or the training pair (inputs, targets) [R, T].
  struct Batch {
    at::Tensor rows_or_inputs;
    std::optional<at::Tensor> targets;
    State state;
  };

  // Every micro-step packs `rows` rows of row_len tokens. The buffer is topped up to buffer_docs
  // documents and 2 * rows * row_len tokens (see refill()); a document read more than wait_factor
  // buffers ago is due (RowPacker::pack). mask_bit: the bit that carries a masked token's
  // "supervised" flag (-1: no masks).
  RowStream(std::vector<DocRun> epoch, int64_t rows, int64_t row_len, int64_t bos_id, int64_t buffer_docs,
            int64_t wait_factor, int64_t mask_bit);
  ~RowStream();
  RowStream(const RowStream&) = delete;
  RowStream& operator=(const RowStream&) = delete;

  // Packs the next global batch and returns rows [first_row, first_row + out_rows) of it: as rows
  // (in pinned memory if `pinned`, for one non-blocking copy to a GPU) or, if `pairs`, as the
  // training pair with targets -1 where a masked token is not supervised.
  Batch next(int64_t first_row, int64_t out_rows, bool pairs, bool pinned);
  State state() const;
  // Continue from a saved state: the buffered documents are read again, in their order.
  void restore(int64_t next_pos, const std::vector<int64_t>& buffer, int64_t batches, int64_t tokens_used,
               int64_t tokens_cropped);
  int64_t n_docs() const { return n_docs_; }

  // A thread runs next(first_row, ...) ahead, keeping up to `depth` batches ready for get(). An
  // error in it is raised by get() once the batches made before it have been taken.
  void start(int64_t depth, int64_t first_row, int64_t out_rows, bool pairs, bool pinned);
  Batch get();
  void stop();  // idempotent; drops the batches not taken
  bool prefetching() const { return thread_.joinable(); }

 private:
  void add(int64_t start, int64_t count);  // stream positions [start, start + count), in order
  void refill();
  void run(int64_t depth, int64_t first_row, int64_t out_rows, bool pairs, bool pinned);
  void check_idle(const char* who) const;
  at::Tensor new_batch_tensor(int64_t rows, int64_t cols);  // from pool_ (pinned memory has torch's own cache)

  std::vector<DocRun> epoch_;
  std::vector<int64_t> run_starts_;  // epoch position of each run's first document; back() = n_docs
  int64_t n_docs_ = 0;
  int64_t rows_, row_len_, buffer_docs_, wait_factor_, mask_bit_;
  RowPacker packer_;
  std::shared_ptr<BlockPool> pool_;
  int64_t next_pos_ = 0, batches_ = 0, tokens_used_ = 0, tokens_cropped_ = 0;

  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable ready_, room_;  // a batch was queued / taken (or stopping)
  std::deque<Batch> queue_;
  std::exception_ptr error_;
  bool stopping_ = false, finished_ = false;
  std::atomic<int64_t> ready_count_{0};  // queue_.size() (+1 once finished), for get() to spin on
  static constexpr int64_t kSpinMicroseconds = 250;
};

}  // namespace nanochat_fast
