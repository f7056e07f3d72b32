// The library as a Python extension module too: `forward_if_finite` (and `forget_step`) called
// from Python without torch's dispatcher. At a decoding step's shape the dispatcher's handling
// of the op's 17 arguments (boxing them, looking for __torch_function__ overrides, unboxing)
// costs a third of the kernel's own time. urpe calls this entry only where the dispatcher would
// add nothing (no gradient, plain tensors, no dispatch or function mode, no torch.func
// transform, not compiling: `ops.NoGradForward`); everything else goes through torch.ops.
//
// Its own file, so that the other sources compile beside it: pybind11 is slow to compile. Only
// torch's pybind11 header with its tensor casters, not torch/extension.h (the whole C++
// frontend besides: twice the time).
#include <torch/csrc/utils/pybind.h>

#include "forget_step.h"
#include "library.h"

// One module name whatever the file's (a cached build's urpe_cpp_<key>.so, a wheel's urpe_cpp.so).
PYBIND11_MODULE(urpe_cpp_entry, module) {
  // the GIL released while the kernel runs, as torch.ops releases it
  module.def("forward_if_finite", &urpe_cpp::forward_if_finite,
             pybind11::call_guard<pybind11::gil_scoped_release>());
  // a FoX decoding step of a transformers model (forget_step.h; urpe/hf/forget_history.py)
  module.def("forget_step", &urpe_cpp::forget_step,
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
