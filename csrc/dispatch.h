// What every kernel file does: register its kernels (torch/library.h) and, on entry, run the op's argument checks
// (its Meta kernel, csrc/ops.cpp), dispatch on the dtype and choose a template instance for run-time flags.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <type_traits>
#include <utility>

// The dtypes every op accepts: fp32, fp16 and bf16 (statistics and sums are computed in fp32 or wider).
#define GTOPK_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace gtopk_ext {

// An op's argument checks as its kernels run them: the call redispatched to the op's Meta kernel (csrc/ops.cpp),
// which checks the arguments and allocates empty outputs on the meta device. So what each op accepts is stated
// once, for every backend and for torch.compile's fake tensors. Signature: the kernel's (the schema's) C++ type.
template <typename Signature>
class OpChecks {
 public:
  explicit OpChecks(const char* name)
      : op_(c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>()) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    op_.redispatch(c10::DispatchKeySet(c10::DispatchKey::Meta), std::forward<Args>(args)...);
  }

 private:
  c10::TypedOperatorHandle<Signature> op_;
};

// Calls f(std::bool_constant<a>{}, std::bool_constant<b>{}): a kernel template instantiated for each pair of
// run-time flags (residual or not, histogram or not), the pair chosen once per call.
template <typename F>
void dispatch_flags(bool a, bool b, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  if (a) {
    b ? f(Yes{}, Yes{}) : f(Yes{}, No{});
  } else {
    b ? f(No{}, Yes{}) : f(No{}, No{});
  }
}

}  // namespace gtopk_ext
