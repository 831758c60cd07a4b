// Admission of new sending connections, shared by every transport: the credential check and the
// credential frame that the socket transports (tcp, cuda_ipc, nccl) send first on a connection.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"
#include "transport/transport.h"

namespace ferry::transport {

// Fails unless `credential` fits kMaxCredentialBytes (a sender checks before it connects).
Status check_credential(std::string_view credential);

// Judges a new connection's credential: its size, then `admit` (empty: identity 0). A refusal is
// logged here, once, naming the transport and `peer` (its address or pid), and comes back as
// Unauthenticated; the caller closes the connection without telling anyone else. The admission
// comes back with its bucket limit resolved: `default_max_bucket` (the transport's
// TransportOptions::max_received_bucket()) where `admit` set none.
Result<Admission> admit_peer(const AdmitCallback& admit, std::string_view credential, std::string_view transport,
                             std::string_view peer, uint64_t default_max_bucket);

// The Status a receiver closes a connection with when it announces a bucket of `size` bytes over
// the connection's `limit`.
Status bucket_over_limit(std::string_view transport, uint64_t size, uint64_t limit);

// Logs that a connection was closed before it presented a credential (a silent or too slow peer,
// or a malformed frame). Once per connection, like a refusal.
void log_unadmitted(std::string_view transport, std::string_view peer, std::string_view why);

// The credential frame: a magic word and the credential's length (4 bytes each, little endian),
// then the credential. A receiver reads the header, refuses a wrong magic or a length over
// kMaxCredentialBytes before reading further, then reads exactly the credential.
inline constexpr uint32_t kCredentialMagic = 0x31435246;  // "FRC1"
inline constexpr size_t kCredentialHeaderBytes = 8;
std::string credential_frame(std::string_view credential);
// The credential's length from a frame's header; an error for a wrong magic or an oversized length.
Result<size_t> credential_length(const std::array<uint8_t, kCredentialHeaderBytes>& header);

}  // namespace ferry::transport
