// The Python binding of RowPacker (pack_rows.h), included by module.cpp only: the rest of csrc/
// builds without Python. Its add() and pack() release the GIL, so a prefetch thread packs while
// the training loop runs.
#pragma once
#include <torch/extension.h>

#include "pack_rows.h"

namespace nanochat_fast {
namespace {

// pybind11 gives its types hidden visibility; binding a local subclass keeps RowPacker itself
// usable from the Python-free build without a visibility mismatch.
struct PyRowPacker : RowPacker {
  using RowPacker::RowPacker;
};

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
}

}  // namespace nanochat_fast
