// The Python bindings of RowPacker (pack_rows.h) and RowStream (pack_rows_stream.h), included by
// module.cpp only: the rest of csrc/ builds without Python. Every call that packs or waits
// releases the GIL, so the training loop runs meanwhile.
#pragma once
#include <torch/extension.h>

#include "pack_rows.h"
#include "pack_rows_stream.h"

namespace nanochat_fast {
namespace {

// pybind11 gives its types hidden visibility; binding a local subclass keeps RowPacker itself
// usable from the Python-free build without a visibility mismatch.
struct PyRowPacker : RowPacker {
  using RowPacker::RowPacker;
};

// Joins the prefetch thread with the GIL released when Python drops the stream.
struct PyRowStream : RowStream {
  using RowStream::RowStream;
  ~PyRowStream() {
    pybind11::gil_scoped_release no_gil;
    stop();
  }
};

inline pybind11::tuple state_to_python(const RowStream::State& s) {
  return pybind11::make_tuple(s.next_pos, s.buffer, s.batches, s.tokens_used, s.tokens_cropped);
}

// (rows or (inputs, targets), state)
inline pybind11::tuple batch_to_python(const RowStream::Batch& b) {
  pybind11::object data = b.targets ? pybind11::object(pybind11::make_tuple(b.rows_or_inputs, *b.targets))
                                    : pybind11::cast(b.rows_or_inputs);
  return pybind11::make_tuple(data, state_to_python(b.state));
}

}  // namespace

inline void bind_row_packer(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<PyRowPacker>(m, "RowPacker",
                          "Best-fit packer with a document buffer kept in C++ (see nanochat_fast.kernels.pack_rows)")
      .def(py::init<int64_t, int64_t>(), py::arg("row_len"), py::arg("bos_id"))
      .def("add", &RowPacker::add, py::arg("tokens"), py::arg("offsets"), py::arg("first_id"),
           py::arg("mask") = py::none(), py::arg("mask_bit") = -1, py::call_guard<py::gil_scoped_release>())
      .def("pack", &RowPacker::pack, py::arg("out"), py::arg("total_rows"), py::arg("first_row") = 0,
           py::arg("due_before") = INT64_MIN, py::arg("targets") = py::none(), py::arg("mask_bit") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("ids", &RowPacker::ids)
      .def("lengths", &RowPacker::lengths)
      .def("clear", &RowPacker::clear)
      .def_property_readonly("num_docs", &RowPacker::num_docs)
      .def_property_readonly("mass", &RowPacker::mass)
      .def_property_readonly("row_len", &RowPacker::row_len)
      .def_property_readonly("bos_id", &RowPacker::bos_id);

  using Run = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>>;
  py::class_<PyRowStream>(m, "RowStream",
                          "A loader's data stream over RowPacker, with a prefetch thread that never takes the GIL "
                          "(see nanochat_fast.kernels.pack_rows_stream.RowStream, its Python twin)")
      .def(py::init([](const std::vector<Run>& epoch, int64_t rows, int64_t row_len, int64_t bos_id,
                       int64_t buffer_docs, int64_t wait_factor, int64_t mask_bit) {
             std::vector<DocRun> runs;
             for (const auto& [tokens, offsets, mask] : epoch) runs.push_back({tokens, offsets, mask});
             py::gil_scoped_release no_gil;
             return std::make_unique<PyRowStream>(std::move(runs), rows, row_len, bos_id, buffer_docs, wait_factor,
                                                  mask_bit);
           }),
           py::arg("epoch"), py::arg("rows"), py::arg("row_len"), py::arg("bos_id"), py::arg("buffer_docs"),
           py::arg("wait_factor"), py::arg("mask_bit") = -1)
      .def(
          "next",
          [](PyRowStream& s, int64_t first_row, int64_t out_rows, bool pairs, bool pinned) {
            TORCH_CHECK(!s.prefetching(), "RowStream.next: not while prefetching (stop() first)");
            RowStream::Batch b;
            {
              py::gil_scoped_release no_gil;
              b = s.next(first_row, out_rows, pairs, pinned);
            }
            return batch_to_python(b);
          },
          py::arg("first_row"), py::arg("out_rows"), py::arg("pairs"), py::arg("pinned") = false)
      .def("state",
           [](const PyRowStream& s) {
             TORCH_CHECK(!s.prefetching(), "RowStream.state: not while prefetching (stop() first)");
             return state_to_python(s.state());
           })
      .def("restore", &RowStream::restore, py::arg("next_pos"), py::arg("buffer"), py::arg("batches"),
           py::arg("tokens_used"), py::arg("tokens_cropped"), py::call_guard<py::gil_scoped_release>())
      .def("start", &RowStream::start, py::arg("depth"), py::arg("first_row"), py::arg("out_rows"), py::arg("pairs"),
           py::arg("pinned") = false)
      .def("get",
           [](PyRowStream& s) {
             RowStream::Batch b;
             {
               py::gil_scoped_release no_gil;
               b = s.get();
             }
             return batch_to_python(b);
           })
      .def("stop", &RowStream::stop, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("prefetching", &RowStream::prefetching)
      .def_property_readonly("n_docs", &RowStream::n_docs);
}

}  // namespace nanochat_fast
