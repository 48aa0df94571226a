// The Python module nanochat_fast._C. Importing it runs the static TORCH_LIBRARY registrations of
// the other translation units; the ops are then reachable as torch.ops.nanochat_fast.*.
#include <torch/extension.h>

#include "pack_rows_python.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "nanochat_fast compiled ops (see torch.ops.nanochat_fast)";
#ifdef NANOCHAT_FAST_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif

  nanochat_fast::bind_row_packer(m);  // pack_rows_python.h
}
