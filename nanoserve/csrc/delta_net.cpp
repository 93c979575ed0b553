// The `delta_rule` extension: Gated DeltaNet's mixer (delta_net.h) as a Python function. What
// it computes and the measured figures: nanoserve/model/delta_net_ops.py.
#include "delta_net.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("delta_rule", &delta_net::delta_rule,
        "Gated DeltaNet's conv and gated delta rule over a flat batch of sequences "
        "(nanoserve/model/delta_net_ops.py)");
  m.def("get_schedule", [] { return schedule::flat(schedule::current()); },
        "this module's kernel schedule (flat)");
  m.def("set_schedule", &schedule::set_flat, "set this module's kernel schedule (flat)");
}
