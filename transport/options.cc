// The edge where transports' settings are read: callers build TransportOptions here once and pass
// them to create_transport(); backends never read FERRY_* variables themselves.
#include "core/settings.h"
#include "transport/transport.h"

namespace ferry::transport {

Result<TransportOptions> transport_options_from_settings() {
  TransportOptions o;
  FERRY_ASSIGN_OR_RETURN(o.listen_host, setting_string("FERRY_LISTEN_HOST"));
  FERRY_ASSIGN_OR_RETURN(o.bucket_bytes, bucket_bytes_setting());
  FERRY_ASSIGN_OR_RETURN(o.buckets_in_flight, setting_int("FERRY_BUCKETS_IN_FLIGHT"));
  FERRY_ASSIGN_OR_RETURN(int64_t ms, setting_int("FERRY_TIMEOUT_MS"));
  o.timeout = std::chrono::milliseconds(ms);
  if (o.buckets_in_flight < 1) return Status::invalid_argument("FERRY_BUCKETS_IN_FLIGHT must be at least 1");
  return o;
}

Result<std::unique_ptr<Transport>> create_transport(std::string_view name) {
  FERRY_ASSIGN_OR_RETURN(TransportOptions options, transport_options_from_settings());
  return create_transport(name, options);
}

}  // namespace ferry::transport
