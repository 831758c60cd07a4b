#include "coordinator/wire.h"

#include <fmt/format.h>

namespace ferry::coordinator {
namespace {

Shape shape_of(const google::protobuf::RepeatedField<int64_t>& f) { return Shape(f.begin(), f.end()); }

// Shapes and offsets from a peer: no negative entry, and a shape's element count fits in int64_t,
// so that the checks that follow (sharding::check_manifest) can do their arithmetic without overflow.
Result<Shape> dims_of(const google::protobuf::RepeatedField<int64_t>& f, bool extent, std::string_view name,
                      std::string_view what) {
  Shape s = shape_of(f);
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) {
      return Status::invalid_argument(fmt::format("{}: {} {} has a negative entry", name, what, shape_to_string(s)));
    }
    if (extent && __builtin_mul_overflow(n, d, &n)) {
      return Status::invalid_argument(
          fmt::format("{}: {} {} has more elements than an int64 counts", name, what, shape_to_string(s)));
    }
  }
  return s;
}

void put(const Shape& s, google::protobuf::RepeatedField<int64_t>* out) {
  out->Clear();
  for (int64_t d : s) out->Add(d);
}

}  // namespace

void to_wire(const Status& st, wire::Status* out) {
  out->set_code(static_cast<int32_t>(st.code()));
  out->set_message(st.message());
}

Status from_wire(const wire::Status& st) {
  if (st.code() < 0 || st.code() > static_cast<int32_t>(StatusCode::kInternal)) {
    return Status::internal(fmt::format("peer sent unknown status code {}: {}", st.code(), st.message()));
  }
  return Status(static_cast<StatusCode>(st.code()), st.message());
}

void to_wire(const sharding::SourceTensor& t, wire::TensorMeta* out) {
  out->set_name(t.name);
  out->set_dtype(std::string(dtype_name(t.dtype)));
  put(t.shape, out->mutable_shape());
}

Result<sharding::SourceTensor> from_wire(const wire::TensorMeta& t) {
  auto dt = parse_dtype(t.dtype());
  if (!dt.ok()) return dt.status().with_context(t.name());
  FERRY_ASSIGN_OR_RETURN(Shape shape, dims_of(t.shape(), true, t.name(), "shape"));
  return sharding::SourceTensor{t.name(), *dt, std::move(shape)};
}

void to_wire(const sharding::RankSpec& spec, wire::RankSpec* out) {
  out->set_replica(spec.replica);
  out->set_tp_rank(spec.tp_rank);
  out->set_tp_size(spec.tp_size);
  for (const auto& t : spec.expects) to_wire(t, out->add_expects());
  for (const auto& p : spec.params) {
    wire::Param* w = out->add_params();
    w->set_name(p.name);
    w->set_layer(p.layer);
    put(p.shape, w->mutable_shape());
    w->set_source_dtype(std::string(dtype_name(p.source_dtype)));
    w->set_scheme(std::string(scheme_name(p.scheme)));
    for (int64_t r : p.shard_rows) w->add_shard_rows(r);
    for (const auto& s : p.slices) {
      wire::Slice* ws = w->add_slices();
      ws->set_source(s.source);
      put(s.src.offset, ws->mutable_src_offset());
      put(s.src.size, ws->mutable_src_size());
      put(s.dst_offset, ws->mutable_dst_offset());
    }
  }
}

Result<sharding::RankSpec> from_wire(const wire::RankSpec& w) {
  sharding::RankSpec spec;
  spec.replica = w.replica();
  spec.tp_rank = w.tp_rank();
  spec.tp_size = w.tp_size();
  FERRY_ASSIGN_OR_RETURN(spec.expects, manifest_from_wire(w.expects()));
  for (const auto& wp : w.params()) {
    sharding::ParamSpec p;
    p.name = wp.name();
    p.layer = wp.layer();
    FERRY_ASSIGN_OR_RETURN(p.shape, dims_of(wp.shape(), true, p.name, "shape"));
    auto dt = parse_dtype(wp.source_dtype());
    if (!dt.ok()) return dt.status().with_context(p.name);
    p.source_dtype = *dt;
    auto scheme = parse_scheme(wp.scheme());
    if (!scheme.ok()) return scheme.status().with_context(p.name);
    p.scheme = *scheme;
    p.shard_rows.assign(wp.shard_rows().begin(), wp.shard_rows().end());
    for (const auto& ws : wp.slices()) {
      sharding::SourceSlice s;
      s.source = ws.source();
      FERRY_ASSIGN_OR_RETURN(s.src.offset, dims_of(ws.src_offset(), false, p.name, "slice offset"));
      FERRY_ASSIGN_OR_RETURN(s.src.size, dims_of(ws.src_size(), true, p.name, "slice size"));
      FERRY_ASSIGN_OR_RETURN(s.dst_offset, dims_of(ws.dst_offset(), false, p.name, "slice destination"));
      if (s.src.offset.size() != s.src.size.size()) {
        return Status::invalid_argument(fmt::format("{}: slice from {} has mismatched offset and size", p.name, s.source));
      }
      p.slices.push_back(std::move(s));
    }
    spec.params.push_back(std::move(p));
  }
  return spec;
}

Result<sharding::Manifest> manifest_from_wire(const google::protobuf::RepeatedPtrField<wire::TensorMeta>& m) {
  sharding::Manifest out;
  out.reserve(static_cast<size_t>(m.size()));
  for (const auto& t : m) {
    FERRY_ASSIGN_OR_RETURN(auto st, from_wire(t));
    out.push_back(std::move(st));
  }
  return out;
}

void to_wire(const sharding::SenderInfo& s, wire::SenderHoldings* out) {
  out->Clear();
  for (const auto& n : s.owns) out->add_owns(n);
  for (const auto& h : s.holds) {
    auto* w = out->add_holds();
    w->set_name(h.name);
    put(h.region.offset, w->mutable_offset());
    put(h.region.size, w->mutable_size());
  }
}

Result<sharding::SenderInfo> from_wire(const wire::SenderHoldings& s) {
  sharding::SenderInfo out;
  out.owns.assign(s.owns().begin(), s.owns().end());
  for (const auto& h : s.holds()) {
    FERRY_ASSIGN_OR_RETURN(Shape offset, dims_of(h.offset(), false, h.name(), "held box offset"));
    FERRY_ASSIGN_OR_RETURN(Shape size, dims_of(h.size(), true, h.name(), "held box size"));
    if (offset.size() != size.size()) {
      return Status::invalid_argument(fmt::format("{}: a held box with {} offsets and {} sizes", h.name(),
                                                  offset.size(), size.size()));
    }
    out.holds.push_back(sharding::Holding{h.name(), Region{std::move(offset), std::move(size)}});
  }
  return out;
}

}  // namespace ferry::coordinator
