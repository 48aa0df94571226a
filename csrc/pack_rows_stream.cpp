// RowStream (pack_rows_stream.h): the data stream over RowPacker, and its prefetch thread.
#include "pack_rows_stream.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#ifdef __linux__
#include <pthread.h>
#endif

namespace nanochat_fast {

BlockPool::BlockPool(size_t bytes) : bytes_(bytes) {
  max_free_ = std::max<size_t>(8, (size_t{64} << 20) / std::max<size_t>(bytes, 1));  // up to 64 MiB, >= 8 blocks
}

BlockPool::~BlockPool() {
  for (void* block : free_) std::free(block);
}

at::Tensor BlockPool::int64_tensor(at::IntArrayRef sizes) {
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      block = free_.back();
      free_.pop_back();
    }
  }
  if (block == nullptr) {
    block = std::aligned_alloc(64, std::max<size_t>(64, (bytes_ + 63) / 64 * 64));  // (a multiple of 64)
    TORCH_CHECK(block != nullptr, "RowStream: out of memory allocating a batch of ", bytes_, " bytes");
  }
  // the tensors keep the pool alive: they may outlive the stream
  return at::from_blob(block, sizes, [pool = shared_from_this()](void* b) { pool->give_back(b); },
                       at::TensorOptions().dtype(at::kLong));
}

void BlockPool::give_back(void* block) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.size() < max_free_) {
    free_.push_back(block);
  } else {
    std::free(block);
  }
}

RowStream::RowStream(std::vector<DocRun> epoch, int64_t rows, int64_t row_len, int64_t bos_id, int64_t buffer_docs,
                     int64_t wait_factor, int64_t mask_bit)
    : epoch_(std::move(epoch)),
      rows_(rows),
      row_len_(row_len),
      buffer_docs_(buffer_docs),
      wait_factor_(wait_factor),
      mask_bit_(mask_bit),
      packer_(row_len, bos_id) {
  TORCH_CHECK_VALUE(rows >= 1, "RowStream: rows must be >= 1, got ", rows);
  TORCH_CHECK_VALUE(buffer_docs >= 1, "RowStream: buffer_docs must be >= 1, got ", buffer_docs);
  TORCH_CHECK_VALUE(wait_factor >= 1, "RowStream: wait_factor must be >= 1, got ", wait_factor);
  TORCH_CHECK_VALUE(mask_bit >= -1 && mask_bit < 31, "RowStream: mask_bit must be in [-1, 31), got ", mask_bit);
  run_starts_.push_back(0);
  for (const DocRun& run : epoch_) {
    const at::Tensor& o = run.offsets;
    TORCH_CHECK_VALUE(o.device().is_cpu() && o.scalar_type() == at::kLong && o.dim() == 1 && o.is_contiguous() &&
                          o.numel() >= 1,
                      "RowStream: a run's offsets must be a contiguous 1-D int64 CPU tensor with >= 1 entry");
    TORCH_CHECK_VALUE(!run.mask || mask_bit >= 0, "RowStream: a run has a mask but mask_bit is -1");
    n_docs_ += o.numel() - 1;
    run_starts_.push_back(n_docs_);
  }
  TORCH_CHECK_VALUE(n_docs_ > 0, "RowStream: the epoch holds no documents");
  refill();
}

RowStream::~RowStream() { stop(); }

void RowStream::check_idle(const char* who) const {
  TORCH_CHECK(!thread_.joinable(), "RowStream.", who, ": not while prefetching (stop() first)");
}

void RowStream::add(int64_t start, int64_t count) {
  int64_t p = start;
  const int64_t end = start + count;
  while (p < end) {
    const int64_t i = p % n_docs_;
    // the run holding epoch position i (the last one starting at or before it: empty runs are skipped)
    const int64_t r = std::upper_bound(run_starts_.begin(), run_starts_.end(), i) - run_starts_.begin() - 1;
    const int64_t n = std::min(end - p, run_starts_[r + 1] - i);
    const DocRun& run = epoch_[r];
    packer_.add_docs(run.tokens, run.offsets.data_ptr<int64_t>() + (i - run_starts_[r]), n, p, run.mask,
                     run.mask ? mask_bit_ : -1);
    p += n;
  }
}

void RowStream::refill() {
  // Top the buffer up to buffer_docs documents and at least 2 * rows * row_len tokens (the packer
  // counts at most row_len of a document): enough for best-fit to fill every row, since filling a
  // row consumes at most 2 * row_len of them (whole documents that fit, plus one that is cropped).
  const int64_t missing = std::max<int64_t>(buffer_docs_ - packer_.num_docs(), 0);
  add(next_pos_, missing);
  next_pos_ += missing;
  const int64_t target = 2 * rows_ * row_len_;
  while (packer_.mass() < target) {  // as many documents as the buffer's average suggests
    const int64_t average = std::max<int64_t>(1, packer_.mass() / std::max<int64_t>(1, packer_.num_docs()));
    const int64_t more = (target - packer_.mass() + average - 1) / average;
    add(next_pos_, more);
    next_pos_ += more;
  }
}

RowStream::Batch RowStream::next(int64_t first_row, int64_t out_rows, bool pairs, bool pinned) {
  TORCH_CHECK_VALUE(first_row >= 0 && out_rows >= 0 && first_row + out_rows <= rows_, "RowStream.next: rows [",
                    first_row, ", ", first_row + out_rows, ") are not within the batch of ", rows_);
  // documents read more than wait_factor buffers ago are due: they start rows (RowPacker::pack)
  const int64_t due_before = next_pos_ - wait_factor_ * packer_.num_docs();
  Batch batch;
  std::tuple<int64_t, int64_t, int64_t> counts;
  if (pairs) {
    batch.rows_or_inputs = new_batch_tensor(out_rows, row_len_ - 1);
    batch.targets = new_batch_tensor(out_rows, row_len_ - 1);
    counts = packer_.pack(batch.rows_or_inputs, rows_, first_row, due_before, batch.targets, mask_bit_);
  } else {
    batch.rows_or_inputs = pinned ? at::empty({out_rows, row_len_}, at::dtype(at::kLong).pinned_memory(true))
                                  : new_batch_tensor(out_rows, row_len_);
    counts = packer_.pack(batch.rows_or_inputs, rows_, first_row, due_before);
  }
  ++batches_;
  tokens_used_ += std::get<1>(counts);
  tokens_cropped_ += std::get<2>(counts);
  refill();
  batch.state = state();
  return batch;
}

at::Tensor RowStream::new_batch_tensor(int64_t rows, int64_t cols) {
  const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(int64_t);
  if (!pool_ || pool_->bytes() != bytes) pool_ = std::make_shared<BlockPool>(bytes);
  return pool_->int64_tensor({rows, cols});
}

RowStream::State RowStream::state() const {
  return {next_pos_, packer_.ids(), batches_, tokens_used_, tokens_cropped_};
}

void RowStream::restore(int64_t next_pos, const std::vector<int64_t>& buffer, int64_t batches, int64_t tokens_used,
                        int64_t tokens_cropped) {
  check_idle("restore");
  for (const int64_t id : buffer)
    TORCH_CHECK_VALUE(id >= 0 && id < next_pos, "RowStream.restore: buffered position ", id, " is not in [0, next_pos=",
                      next_pos, ")");
  packer_.clear();
  size_t k = 0;
  while (k < buffer.size()) {  // re-add the buffered documents in buffer order, consecutive runs at once
    size_t n = 1;
    while (k + n < buffer.size() && buffer[k + n] == buffer[k] + static_cast<int64_t>(n)) ++n;
    add(buffer[k], static_cast<int64_t>(n));
    k += n;
  }
  next_pos_ = next_pos;
  batches_ = batches;
  tokens_used_ = tokens_used;
  tokens_cropped_ = tokens_cropped;
  refill();
}

// ---------------------------------------------------------------------------------------------
// prefetching

void RowStream::start(int64_t depth, int64_t first_row, int64_t out_rows, bool pairs, bool pinned) {
  TORCH_CHECK(!thread_.joinable(), "RowStream.start: already prefetching");
  TORCH_CHECK_VALUE(depth >= 1, "RowStream.start: depth must be >= 1, got ", depth);
  TORCH_CHECK_VALUE(first_row >= 0 && out_rows >= 0 && first_row + out_rows <= rows_, "RowStream.start: rows [",
                    first_row, ", ", first_row + out_rows, ") are not within the batch of ", rows_);
  queue_.clear();
  ready_count_.store(0);
  error_ = nullptr;
  stopping_ = finished_ = false;
  thread_ = std::thread(&RowStream::run, this, depth, first_row, out_rows, pairs, pinned);
}

void RowStream::run(int64_t depth, int64_t first_row, int64_t out_rows, bool pairs, bool pinned) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), "nanochat-rows");  // what top, py-spy and the tests see
#endif
  try {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        room_.wait(lock, [&] { return stopping_ || static_cast<int64_t>(queue_.size()) < depth; });
        if (stopping_) break;
      }
      Batch batch = next(first_row, out_rows, pairs, pinned);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) break;
        queue_.push_back(std::move(batch));
        ready_count_.store(static_cast<int64_t>(queue_.size()), std::memory_order_release);
      }
      ready_.notify_one();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
    ready_count_.store(static_cast<int64_t>(queue_.size()) + 1, std::memory_order_release);  // get() must look
  }
  ready_.notify_all();
}

RowStream::Batch RowStream::get() {
  TORCH_CHECK(thread_.joinable(), "RowStream.get: not prefetching (start() first)");
  // Waiting for the next batch, spin a little before sleeping: on a virtual machine waking a sleeping
  // thread can cost the waker about as long as a batch takes (the signal is an inter-processor
  // interrupt, which exits to the hypervisor: docs/measurements.md#token-packing). A spinning consumer
  // leaves the producer's notify with no one to wake. Past a few batches' time the producer is held up
  // anyway (a busy machine), and this thread sleeps instead.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
  while (ready_count_.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::yield();  // (should the producer be waiting for this very CPU)
  }
  std::unique_lock<std::mutex> lock(mutex_);
  ready_.wait(lock, [&] { return !queue_.empty() || finished_; });
  if (!queue_.empty()) {
    Batch batch = std::move(queue_.front());
    queue_.pop_front();
    ready_count_.store(static_cast<int64_t>(queue_.size()) + (finished_ ? 1 : 0), std::memory_order_release);
    lock.unlock();
    room_.notify_one();
    return batch;
  }
  if (error_) std::rethrow_exception(error_);
  TORCH_CHECK(false, "RowStream.get: the prefetch thread stopped");
}

void RowStream::stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  room_.notify_all();
  thread_.join();
  queue_.clear();
  ready_count_.store(0);
  error_ = nullptr;
  stopping_ = finished_ = false;
}

}  // namespace nanochat_fast
