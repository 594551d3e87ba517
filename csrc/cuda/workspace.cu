// The kernels' workspace (common.cuh): one per (device, stream), kept for the life of the process.
#include "common.cuh"

namespace gtopk_ext::cuda {
namespace {

constexpr size_t kCountersBytes = scratch_piece(sizeof(ZeroedCounters));

struct Workspace {
  std::mutex mutex;                 // held by a call from its lease to its last launch
  std::vector<at::Tensor> buffers;  // the one in use last; the smaller ones before it stay for captured graphs
};

Workspace& workspace_of(int device, cudaStream_t stream) {
  static std::mutex mutex;
  // Never destroyed: the buffers must outlive every graph and stream that uses them.
  static auto* workspaces = new std::map<std::pair<int, cudaStream_t>, std::unique_ptr<Workspace>>();
  const std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<Workspace>& workspace = (*workspaces)[{device, stream}];
  if (!workspace) workspace = std::make_unique<Workspace>();
  return *workspace;
}

}  // namespace

WorkspaceLease lease_workspace(const at::Device& device, cudaStream_t stream, size_t scratch_bytes) {
  Workspace& workspace = workspace_of(device.index(), stream);
  std::unique_lock<std::mutex> lock(workspace.mutex);
  const int64_t needed = static_cast<int64_t>(kCountersBytes + scratch_bytes);
  if (workspace.buffers.empty() || workspace.buffers.back().numel() < needed) {
    // At least twice the last size, so that buckets of a few sizes settle on one buffer after a growth or two.
    const int64_t last = workspace.buffers.empty() ? 0 : workspace.buffers.back().numel();
    at::Tensor buffer = at::empty({std::max(needed, 2 * last)}, at::TensorOptions().dtype(at::kByte).device(device));
    C10_CUDA_CHECK(cudaMemsetAsync(buffer.mutable_data_ptr(), 0, sizeof(ZeroedCounters), stream));
    workspace.buffers.push_back(std::move(buffer));
  }
  char* base = static_cast<char*>(workspace.buffers.back().mutable_data_ptr());
  return {std::move(lock), reinterpret_cast<ZeroedCounters*>(base), base + kCountersBytes};
}

}  // namespace gtopk_ext::cuda
