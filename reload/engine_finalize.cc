// The end of an update: finalize() (completion, census), rollback() and abort().
#include "reload/engine.h"

#include <fmt/format.h>

#include "core/log.h"

namespace ferry::reload {

Result<EngineReport> ReloadEngine::finalize() {
  if (!in_update_) return Status::failed_precondition("finalize outside an update");
  // Layers whose every parameter has no expected slices complete without pieces.
  for (Layer& l : layers_) {
    if (l.processed || l.refused) continue;
    bool done = true;
    for (uint32_t q : l.params) done = done && complete(params_[q]);
    if (done) FERRY_RETURN_IF_ERROR(process(l));
  }
  // What never arrived, by the checkpoint tensors the trainer sends (a parameter's slices each come
  // from one), and the layers left incomplete.
  std::vector<std::string> absent;
  std::string layers;
  int n_missing = 0;
  for (const Layer& l : layers_) {
    if (l.processed) continue;
    if (++n_missing <= 4)
      layers += fmt::format("{}{}{}", layers.empty() ? "" : ", ", l.name, l.refused ? " (refused)" : "");
    for (uint32_t q : l.params) {
      const Param& p = params_[q];
      const sharding::ParamSpec& ps = spec_.params[q];
      for (size_t i = 0; i < p.coverage.size(); ++i) {
        if (p.coverage[i].complete()) continue;
        if (p.inputs.size() != 1) {  // whole checkpoint tensors, under their own names
          absent.push_back(input_name(q, static_cast<uint32_t>(i)));
          continue;
        }
        for (size_t k : p.coverage[i].incomplete_slices()) {
          const auto& sl = ps.slices[k];
          absent.push_back(fmt::format("{} {}", sl.source, sl.src.to_string()));
        }
      }
    }
  }
  std::string missing;
  for (size_t i = 0; i < absent.size() && i < 8; ++i) missing += (i ? ", " : "") + absent[i];
  if (absent.size() > 8) missing += fmt::format(" and {} more", absent.size() - 8);
  // Every kernel of the update has finished (and reported its error) before the update ends: lent
  // device pieces are only guaranteed until then.
  if (Status synced = device_synchronize(storage_.device()); !synced.ok()) {
    in_update_ = false;
    for (Layer& l : layers_) release(l);
    settle_pool();
    return synced.with_context(fmt::format("update v{}", version_));
  }
  report_.census = census();
  report_.snapshot_bytes = snapshots_.bytes();
  in_update_ = false;
  for (Layer& l : layers_) release(l);
  settle_pool();
  if (!unknown_.empty()) {
    std::string names;
    for (size_t i = 0; i < unknown_.size() && i < 8; ++i) names += " " + unknown_[i];
    return Status::not_found(fmt::format("update v{} received {} pieces for tensors this rank does not hold:{}{}",
                                         version_, unknown_.size(), names, unknown_.size() > 8 ? " ..." : ""));
  }
  if (n_missing) {
    return Status::failed_precondition(
        fmt::format("update v{} never received {}{}; {} of {} layers are incomplete: {}{}", version_,
                    absent.empty() ? "every piece of a layer" : "checkpoint tensors: ", missing, n_missing,
                    layers_.size(), layers, n_missing > 4 ? ", ..." : ""));
  }
  if (report_.census.moved) {
    std::string names;
    for (size_t i = 0; i < report_.census.moved_names.size() && i < 8; ++i) names += " " + report_.census.moved_names[i];
    return Status::internal(fmt::format("census after update v{}: {} registered tensors moved:{}", version_,
                                        report_.census.to_string(), names));
  }
  // A complete version: nothing to go back to any more.
  snapshots_.drop();
  complete_version_ = version_;
  // Every input was covered exactly: the shadow holds this version whole, unless some pieces
  // bypassed it.
  shadow_version_ = options_.delta_shadow && !shadow_stale_ ? version_ : 0;
  // A shadow that was bypassed, or that no sender may send deltas against, is memory for nothing:
  // it goes, and stays unwritten until a sender that may send deltas is heard from (note_sender()).
  shadow_unwanted_ = shadow_bypassed_ || (!no_delta_senders_.empty() && !heard_deltas_);
  if (shadow_unwanted_) shadow_version_ = 0;
  if (shadow_version_ == 0 && !shadow_.empty()) {
    shadow_.clear();
    report_.shadow_bytes = 0;
  }
  return report_;
}

void ReloadEngine::settle_pool() {
  // The host pool keeps what updates hold at their peak, so that the next update shaped like them
  // allocates nothing; one that held at most half of it (in plan order again) gives the rest back,
  // and so does a staged update (every layer's staging at once is not kept between updates).
  pool_.settle_host(largest_layer_bytes_, !staged_update_);
  report_.allocated_staging_bytes = pool_.allocated_bytes() - allocated_at_begin_;
}

Status ReloadEngine::rollback() {
  if (rollback_ != RollbackMode::kHost) {
    return Status::failed_precondition("rollback is off (EngineOptions::rollback or FERRY_ROLLBACK=host turns it on)");
  }
  for (Layer& l : layers_) release(l);
  in_update_ = false;
  settle_pool();
  const Census c = census();
  if (c.moved) {
    return Status::internal(fmt::format("rollback to v{}: {} registered tensors moved, no live storage to restore",
                                        complete_version_, c.to_string()));
  }
  const size_t layers = snapshots_.layers();
  FERRY_RETURN_IF_ERROR(snapshots_.restore().with_context(fmt::format("rollback to v{}", complete_version_)));
  FERRY_RETURN_IF_ERROR(device_synchronize(storage_.device()));
  FERRY_LOG_INFO("update v{} rolled back: {} layers restored to v{} from host snapshots", version_, layers,
                 complete_version_);
  snapshots_.drop();
  version_ = complete_version_;
  shadow_version_ = 0;  // the shadow took the aborted update's pieces
  return ok_status();
}

void ReloadEngine::abort() {
  // Kernels still reading lent pieces finish before their owners may reuse the bytes.
  if (Status st = device_synchronize(storage_.device()); !st.ok()) FERRY_LOG_WARN("abort: {}", st.message());
  for (Layer& l : layers_) release(l);
  borrowed_.clear();
  in_update_ = false;
  settle_pool();
}

Census ReloadEngine::census() const { return registry_.census(storage_.tensors()); }

}  // namespace ferry::reload
