// TransportOptions from a snapshot of the settings; backends never read FERRY_* variables.
#include "core/settings.h"
#include "transport/transport.h"

namespace ferry::transport {

TransportOptions transport_options(const Settings& settings) {
  TransportOptions o;
  o.listen_host = settings.listen_host;
  o.bucket_bytes = settings.bucket_bytes;
  o.buckets_in_flight = settings.buckets_in_flight;
  o.timeout = std::chrono::milliseconds(settings.timeout_ms);
  o.tcp_max_rate = static_cast<uint64_t>(settings.tcp_max_mbit) * 1'000'000 / 8;
  return o;
}

Result<TransportOptions> transport_options_from_settings() {
  FERRY_ASSIGN_OR_RETURN(const Settings settings, load_settings());
  return transport_options(settings);
}

Result<std::unique_ptr<Transport>> create_transport(std::string_view name) {
  FERRY_ASSIGN_OR_RETURN(TransportOptions options, transport_options_from_settings());
  return create_transport(name, options);
}

}  // namespace ferry::transport
