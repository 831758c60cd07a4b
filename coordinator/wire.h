// Conversions between ferry's types and their control-plane messages.
#pragma once

#include "core/status.h"
#include "proto/ferry.pb.h"
#include "sharding/model_spec.h"
#include "sharding/planner.h"

namespace ferry::coordinator {

void to_wire(const Status& st, wire::Status* out);
Status from_wire(const wire::Status& st);

void to_wire(const sharding::SourceTensor& t, wire::TensorMeta* out);
Result<sharding::SourceTensor> from_wire(const wire::TensorMeta& t);

void to_wire(const sharding::RankSpec& spec, wire::RankSpec* out);
Result<sharding::RankSpec> from_wire(const wire::RankSpec& spec);

// A trainer rank's holdings (sharding/holdings.h). Boxes from a peer are checked for shape only
// (non-negative, as many offsets as sizes); resolve_holdings() checks them against the manifest.
void to_wire(const sharding::SenderInfo& s, wire::SenderHoldings* out);
Result<sharding::SenderInfo> from_wire(const wire::SenderHoldings& s);

Result<sharding::Manifest> manifest_from_wire(const google::protobuf::RepeatedPtrField<wire::TensorMeta>& m);

}  // namespace ferry::coordinator
