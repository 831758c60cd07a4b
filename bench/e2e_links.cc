#include "bench/e2e_links.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <thread>

#include <fmt/format.h>

#include "coordinator/channel.h"
#include "coordinator/mailbox.h"
#include "core/asio.h"
#include "core/buffer.h"
#include "core/region_copy.h"
#include "dataplane/bucket.h"
#include "dataplane/bucket_sender.h"
#include "dataplane/delta_base.h"
#include "dataplane/piece_pack.h"
#include "sharding/cost_model.h"
#include "sharding/llama.h"
#include "transport/transport.h"

namespace ferry::e2e {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using namespace std::chrono_literals;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One sender's posts to the ranks over its connections (one per rank), at most `slots` in flight to
// each, each from that rank's next bucket buffer of `regions` (`slots` per rank) in turn.
class Window {
 public:
  Window(std::vector<std::unique_ptr<transport::Connection>>& conns,
         std::vector<std::unique_ptr<transport::MemoryRegion>>& regions, size_t slots)
      : conns_(conns), regions_(regions), slots_(slots), pending_(conns.size()), next_(conns.size(), 0) {}

  // `bytes` to rank r, once one of its posts in flight completed if `slots` are.
  Status post(size_t r, size_t bytes) {
    if (pending_[r].size() == slots_) {
      FERRY_RETURN_IF_ERROR(pending_[r].front()->wait(deadline_));
      pending_[r].pop_front();
    }
    const size_t slot = r * slots_ + (next_[r]++ % slots_);
    FERRY_ASSIGN_OR_RETURN(auto h, conns_[r]->post(*regions_[slot], 0, bytes));
    pending_[r].push_back(std::move(h));
    return ok_status();
  }

  // Until this side has seen every post complete.
  Status done() {
    for (auto& p : pending_) {
      for (auto& h : p) FERRY_RETURN_IF_ERROR(h->wait(deadline_));
    }
    return ok_status();
  }

 private:
  std::vector<std::unique_ptr<transport::Connection>>& conns_;
  std::vector<std::unique_ptr<transport::MemoryRegion>>& regions_;
  const size_t slots_;
  const Clock::time_point deadline_ = Clock::now() + 300s;
  std::vector<std::deque<std::unique_ptr<transport::TransferHandle>>> pending_;
  std::vector<size_t> next_;
};

Status expect_reply(ProbeSocket& s, std::string_view want, std::string* rest = nullptr) {
  FERRY_ASSIGN_OR_RETURN(std::string frame, s.recv(Clock::now() + 120s));
  std::string_view r;
  if (command_of(frame, &r) != want) {
    return Status::internal(fmt::format("bench rank answered '{}' where '{}' was expected", frame.substr(0, 80), want));
  }
  if (rest) *rest = std::string(r);
  return ok_status();
}

constexpr int kSmallBuckets = 64;  // per rank, of 4 KiB: the fixed cost of a bucket
constexpr auto kRoundTripGap = std::chrono::milliseconds(5);

class Probe final : public LinkProbe {
 public:
  Probe(std::vector<ProbeSocket>& ranks, const sharding::Plan& plan, const std::vector<sharding::RankSpec>& specs,
        const sharding::Manifest& manifest, int in_flight, const PackDeltas& deltas, int senders)
      : ranks_(ranks), plan_(plan), specs_(specs), manifest_(manifest), senders_(std::max(1, senders)),
        slots_(static_cast<size_t>(std::max(1, in_flight))), work_(asio::make_work_guard(io_)), acceptor_(io_) {
    deltas_ = deltas;
    if (deltas.max_bytes > 0) bases_ = std::make_unique<dataplane::DeltaBases>(deltas.max_bytes);
  }

  ~Probe() override {
    conns_.clear();
    for (auto& tx : tx_) tx->shutdown();
    for (auto& c : channels_) c->close(Status::unavailable("probe done"));
    asio::post(io_, [this] {
      boost::system::error_code ec;
      acceptor_.close(ec);
    });
    work_.reset();
    if (thread_.joinable()) thread_.join();
  }

  Status open(const std::string& transport) {
    FERRY_RETURN_IF_ERROR(open_control());
    // A transport, and over it a connection to every rank, per sender of the overlap probe, as every
    // trainer rank has its own (a transport's I/O threads serve its connections); the first also
    // carries the transport's measurements alone.
    for (int s = 0; s < senders_; ++s) {
      FERRY_ASSIGN_OR_RETURN(auto tx, transport::create_transport(transport));
      tx_.push_back(std::move(tx));
    }
    conns_.resize(static_cast<size_t>(senders_));
    for (auto& r : ranks_) {
      FERRY_RETURN_IF_ERROR(r.send("listen"));
      std::string blob;
      FERRY_RETURN_IF_ERROR(expect_reply(r, "blob", &blob));
      for (size_t s = 0; s < conns_.size(); ++s) {
        FERRY_ASSIGN_OR_RETURN(auto c, tx_[s]->connect(blob, Clock::now() + 30s, {}));
        conns_[s].push_back(std::move(c));
      }
    }
    sizes_.assign(ranks_.size(), {});
    size_t largest = 4096;
    for (const auto& b : plan_.buckets) {
      if (b.dst < 0 || static_cast<size_t>(b.dst) >= ranks_.size()) return Status::internal("plan bucket outside the replica");
      sizes_[static_cast<size_t>(b.dst)].push_back(b.bytes);
      largest = std::max<size_t>(largest, b.bytes);
      plan_bytes_ += b.bytes;
    }
    // A pool of buffers per rank, as the trainer keeps. The posts only read them, so the senders
    // share them, each registering them with its transport.
    regions_.resize(tx_.size());
    for (size_t i = 0; i < ranks_.size() * slots_; ++i) {
      FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(largest));
      std::memset(b.data(), static_cast<int>(i + 1), b.size());
      for (size_t s = 0; s < tx_.size(); ++s) {
        FERRY_ASSIGN_OR_RETURN(auto reg, tx_[s]->register_memory(b.data(), b.size(), Device::cpu()));
        regions_[s].push_back(std::move(reg));
      }
      bufs_.push_back(std::move(b));
    }
    // Bucket builders for packing, sized as the trainer sizes them: a set per sender packing at once.
    packers_.resize(static_cast<size_t>(senders_));
    for (Packer& pk : packers_) {
      for (size_t d = 0; d < ranks_.size(); ++d) {
        pk.builders.push_back(std::make_unique<dataplane::BucketBuilder>(dataplane::bucket_capacity(plan_, d)));
        if (!pk.builders.back()->ok()) return Status::resource_exhausted("bucket buffer for the packing probe");
      }
    }
    return ok_status();
  }

  Status round(bool keep) override {
    FERRY_RETURN_IF_ERROR(round_trips(keep));
    FERRY_RETURN_IF_ERROR(processing(keep));
    FERRY_RETURN_IF_ERROR(transport(keep));
    FERRY_RETURN_IF_ERROR(packing(keep));
    FERRY_RETURN_IF_ERROR(overlap(keep, 1));
    return senders_ > 1 ? overlap(keep, senders_) : ok_status();
  }

  Links links() const override {
    Links l;
    l.round_trip_seconds = median(rtt_);
    l.pack_bytes_per_second = static_cast<double>(plan_.total_bytes) / median(pack_);
    l.process_bytes_per_second = slowest_rate(process_, process_bytes_);
    if (senders_ > 1) l.process_many_bytes_per_second = slowest_rate(process_many_, process_bytes_);
    // A link's time is bytes / rate + buckets * fixed: two runs, two unknowns.
    const double small_buckets = static_cast<double>(kSmallBuckets * ranks_.size());
    const double big_bytes = static_cast<double>(plan_bytes_);
    const auto fit = sharding::fit_link(big_bytes, static_cast<double>(plan_.buckets.size()), median(big_),
                                        small_buckets * 4096, small_buckets, median(small_));
    if (fit.ok()) {
      l.host_bytes_per_second = fit->bytes_per_second;
      l.seconds_per_bucket = fit->seconds_per_bucket;
    } else {  // noise swamped one of them: keep the bytes
      l.host_bytes_per_second = big_bytes / median(big_);
    }
    l.overlap_seconds = median(overlap_one_);
    l.overlap_many_seconds = median(overlap_many_);
    l.host_parallelism = parallelism(overlap_one_, 1, l.process_bytes_per_second);
    if (senders_ > 1) l.host_parallelism_many = parallelism(overlap_many_, senders_, l.process_many_bytes_per_second);
    return l;
  }

 private:
  // A control channel per rank, over ferry's Channel: the rank answers on its own I/O thread; here
  // a waiting thread takes the answer from a mailbox, as the trainer takes the coordinator's.
  Status open_control() {
    boost::system::error_code ec;
    acceptor_.open(tcp::v4(), ec);
    if (!ec) acceptor_.bind(tcp::endpoint(asio::ip::address_v4::loopback(), 0), ec);
    if (!ec) acceptor_.listen(64, ec);
    if (ec) return Status::unavailable("control probe listen: " + ec.message());
    const uint16_t port = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { io_.run(); });
    for (size_t r = 0; r < ranks_.size(); ++r) {
      auto accepted = std::make_shared<std::promise<Result<tcp::socket>>>();
      auto fut = accepted->get_future();
      acceptor_.async_accept([accepted](boost::system::error_code e, tcp::socket s) {
        if (e) return accepted->set_value(Status::unavailable("control probe accept: " + e.message()));
        accepted->set_value(std::move(s));
      });
      FERRY_RETURN_IF_ERROR(ranks_[r].send(fmt::format("control {}", port)));
      if (fut.wait_for(30s) != std::future_status::ready) {
        return Status::deadline_exceeded("bench rank did not open its control channel");
      }
      FERRY_ASSIGN_OR_RETURN(tcp::socket socket, fut.get());
      auto ch = std::make_shared<coordinator::Channel>(std::move(socket), 1u << 20);
      coordinator::Mailbox* box = &boxes_.emplace_back();
      ch->start([box](const std::shared_ptr<coordinator::Channel>&, wire::Envelope& e) { box->push(std::move(e)); },
                [box](const std::shared_ptr<coordinator::Channel>&, const Status& why) { box->close(why); });
      channels_.push_back(std::move(ch));
      FERRY_RETURN_IF_ERROR(expect_reply(ranks_[r], "ok"));
    }
    return ok_status();
  }

  Status round_trips(bool keep) {
    for (int i = 0; i < 10; ++i) {
      for (size_t r = 0; r < ranks_.size(); ++r) {
        wire::Envelope ping;
        ping.mutable_pause()->set_version(++pings_);
        const auto t0 = Clock::now();
        channels_[r]->send(ping);
        FERRY_RETURN_IF_ERROR(boxes_[r].wait(wire::Envelope::kPauseAck, Clock::now() + 10s, "pause ack").status());
        if (keep) rtt_.push_back(since(t0));
        // An update's round trips come one at a time, between stretches of other work or of
        // idleness that let the processes' CPUs go idle; so do these.
        std::this_thread::sleep_for(kRoundTripGap);
      }
    }
    return ok_status();
  }

  // The host's stages one at a time as the cost model adds them up (the busiest sender's packing,
  // the transport from this process, every rank's processing at the slowest rank's rate), over the
  // time the host took doing them at once: how many stages' worth of work it does at a time (below
  // 1 where doing them at once costs more than one after another; the cost model takes at least 1).
  double parallelism(const std::vector<double>& together, int senders, double process_rate) const {
    if (together.empty() || process_rate <= 0) return 1;
    double one_at_a_time = median(pack_) / senders + median(big_);
    for (const auto& [r, bytes] : process_bytes_) one_at_a_time += static_cast<double>(bytes) / process_rate;
    return one_at_a_time / median(together);
  }

  static double slowest_rate(const std::map<size_t, std::vector<double>>& times,
                             const std::map<size_t, uint64_t>& bytes) {
    double slowest = 0;
    for (const auto& [r, t] : times) {
      const double rate = static_cast<double>(bytes.at(r)) / median(t);
      slowest = slowest == 0 ? rate : std::min(slowest, rate);
    }
    return slowest;
  }

  // Each rank alone, with the host to itself: its pieces as one trainer sends them, and (several
  // senders) as senders_ trainer ranks cut them.
  Status processing(bool keep) {
    std::vector<int> cuts{1};
    if (senders_ > 1) cuts.push_back(senders_);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      for (const int senders : cuts) {
        FERRY_RETURN_IF_ERROR(ranks_[r].send(fmt::format("process 3 {}", senders)));
        std::string rest;
        FERRY_RETURN_IF_ERROR(expect_reply(ranks_[r], "processed", &rest));
        unsigned long long bytes = 0;
        double seconds = 0;
        if (std::sscanf(rest.c_str(), "%llu %lf", &bytes, &seconds) != 2 || seconds <= 0) {
          return Status::internal("bench rank sent a malformed processing result: " + rest);
        }
        process_bytes_[r] = bytes;
        if (keep) (senders == 1 ? process_ : process_many_)[r].push_back(seconds);
      }
    }
    return ok_status();
  }

  // Posts `rounds` rounds of `per_rank` buckets to every rank, round-robin over the ranks, at most
  // `slots_` in flight per rank; returns the seconds until every rank has received all of them.
  Result<double> post_all(const std::vector<std::vector<size_t>>& per_rank, uint64_t rounds) {
    FERRY_RETURN_IF_ERROR(announce(per_rank, rounds));
    const auto t0 = Clock::now();
    FERRY_RETURN_IF_ERROR(post(per_rank, rounds));
    for (auto& r : ranks_) FERRY_RETURN_IF_ERROR(expect_reply(r, "received"));
    return since(t0);
  }

  // Tells every rank how many buckets to count before it answers "received".
  Status announce(const std::vector<std::vector<size_t>>& per_rank, uint64_t rounds) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      FERRY_RETURN_IF_ERROR(ranks_[r].send(fmt::format("expect {}", per_rank[r].size() * rounds)));
      FERRY_RETURN_IF_ERROR(expect_reply(ranks_[r], "ok"));
    }
    return ok_status();
  }

  // post_all()'s buckets, until this side has seen every one complete.
  Status post(const std::vector<std::vector<size_t>>& per_rank, uint64_t rounds) {
    Window window(conns_[0], regions_[0], slots_);
    size_t most = 0;
    for (const auto& v : per_rank) most = std::max(most, v.size());
    for (uint64_t round = 0; round < rounds; ++round) {
      for (size_t k = 0; k < most; ++k) {
        for (size_t r = 0; r < ranks_.size(); ++r) {
          if (k < per_rank[r].size()) FERRY_RETURN_IF_ERROR(window.post(r, per_rank[r][k]));
        }
      }
    }
    return window.done();
  }

  Status transport(bool keep) {
    const std::vector<std::vector<size_t>> small(ranks_.size(), std::vector<size_t>(kSmallBuckets, 4096));
    FERRY_ASSIGN_OR_RETURN(double ts, post_all(small, 1));
    // An update's worth: the plan's buckets once.
    FERRY_ASSIGN_OR_RETURN(double tb, post_all(sizes_, 1));
    if (keep) {
      small_.push_back(ts);
      big_.push_back(tb);
    }
    return ok_status();
  }

  // A new version's weights packed into the plan's buckets in the warm bucket buffers, as the trainer
  // does every update: with deltas on, each part compared with the copy of the version packed
  // before and sent whole or as a delta, and each tensor's copy kept after it (dataplane::pack_part,
  // DeltaBases), which every byte pays.
  Status packing(bool keep) {
    for (int i = 0; i < 3; ++i) {
      const uint64_t version = 1000 + (++packs_);
      const Weights w(manifest_, version);
      const auto t0 = Clock::now();
      FERRY_RETURN_IF_ERROR(pack(w, packers_[0]));
      if (bases_) {
        for (size_t t = 0; t < manifest_.size(); ++t) {
          bases_->record(manifest_[t].name, Region::whole(manifest_[t].shape), w.views[t], version);
        }
      }
      if (keep) pack_.push_back(since(t0));
    }
    return ok_status();
  }

  // The builders of one sender packing at a time, and what its packing keeps between parts.
  struct Packer {
    std::vector<std::unique_ptr<dataplane::BucketBuilder>> builders;  // per rank
    dataplane::PackScratch scratch;
    dataplane::DeltaTally tally;
  };

  // Packs every bucket of the plan of `w` with `pk`.
  Status pack(const Weights& w, Packer& pk) {
    for (size_t k = 0; k < plan_.buckets.size(); ++k) FERRY_RETURN_IF_ERROR(pack_one(w, pk, k));
    return ok_status();
  }

  // Packs the plan's bucket k of `w` with `pk`.
  Status pack_one(const Weights& w, Packer& pk, size_t k) {
    const sharding::Bucket& bucket = plan_.buckets[k];
    dataplane::BucketBuilder& b = *pk.builders[static_cast<size_t>(bucket.dst)];
    b.reset(1, 0, 0);
    for (const sharding::BucketPart& part : bucket.parts) {
      const sharding::Piece& pc = plan_.pieces[static_cast<size_t>(part.piece)];
      const auto& param = specs_[static_cast<size_t>(pc.dst)].params[static_cast<size_t>(pc.param)];
      const auto [src, dst] =
          sharding::part_regions(pc.src, sharding::piece_dst_region(pc, param), part.first_row, part.rows);
      const auto& source = manifest_[static_cast<size_t>(pc.source)];
      const TensorView& tensor = w.views[static_cast<size_t>(pc.source)];
      const dataplane::DeltaBases::Base* base =
          bases_ ? bases_->find(source.name, Region::whole(source.shape), source.dtype, source.shape) : nullptr;
      const size_t row_bytes = part.rows > 0 ? part.bytes / static_cast<size_t>(part.rows) : 0;
      FERRY_RETURN_IF_ERROR(dataplane::pack_part(
          b, Device::cpu(), static_cast<uint32_t>(pc.param), src, dst, source.dtype, std::nullopt, tensor, tensor,
          part.first_row, part.rows, row_bytes, base, {deltas_.prefer, deltas_.zstd}, pk.scratch, pk.tally));
    }
    return b.seal(false).status();
  }

  // Sender s of `senders`: packs every senders-th of the plan's buckets from its s-th and posts each,
  // once packed, over a connection of its own to the bucket's rank (at most slots_ in flight to
  // each), as a trainer rank packs and sends its own buckets; returns once every post completed.
  Status send_share(const Weights& w, size_t s, size_t senders) {
    Window window(conns_[s], regions_[s], slots_);
    for (size_t k = s; k < plan_.buckets.size(); k += senders) {
      FERRY_RETURN_IF_ERROR(pack_one(w, packers_[s], k));
      FERRY_RETURN_IF_ERROR(window.post(static_cast<size_t>(plan_.buckets[k].dst), plan_.buckets[k].bytes));
    }
    return window.done();
  }

  // The host's stages at once: `senders` threads each packing every senders-th of the (one-sender)
  // plan's buckets and sending each as it is packed over connections of its own (send_share), and
  // every rank processing its pieces as `senders` trainer ranks cut them. Times from "go" until all
  // are done. Unlike an update, a rank's processing does not wait for the buckets to arrive, so this
  // leans towards more overlap than an update gets.
  Status overlap(bool keep, int senders) {
    FERRY_RETURN_IF_ERROR(announce(sizes_, 1));
    // Every rank prepares at once; each then waits for "go".
    for (auto& r : ranks_) FERRY_RETURN_IF_ERROR(r.send(fmt::format("overlap {}", senders)));
    for (auto& r : ranks_) FERRY_RETURN_IF_ERROR(expect_reply(r, "prepared"));
    const Weights w(manifest_, 1000 + (++packs_));
    const auto t0 = Clock::now();
    for (auto& r : ranks_) FERRY_RETURN_IF_ERROR(r.send("go"));
    std::vector<Status> sent(static_cast<size_t>(senders));
    {
      std::vector<std::jthread> threads;
      for (size_t s = 1; s < sent.size(); ++s) {
        threads.emplace_back([&, s] { sent[s] = send_share(w, s, sent.size()); });
      }
      sent[0] = send_share(w, 0, sent.size());
    }
    for (const Status& st : sent) FERRY_RETURN_IF_ERROR(st);
    for (auto& r : ranks_) {  // "received" and "processed", one of each, in either order
      bool received = false, processed = false;
      for (int k = 0; k < 2; ++k) {
        FERRY_ASSIGN_OR_RETURN(std::string frame, r.recv(Clock::now() + 120s));
        const std::string_view word = command_of(frame);
        bool& seen = word == "received" ? received : processed;
        if ((word != "received" && word != "processed") || seen) {
          return Status::internal(
              fmt::format("bench rank answered '{}' during the overlap probe", frame.substr(0, 80)));
        }
        seen = true;
      }
    }
    if (keep) (senders == 1 ? overlap_one_ : overlap_many_).push_back(since(t0));
    return ok_status();
  }

  std::vector<ProbeSocket>& ranks_;
  const sharding::Plan& plan_;
  const std::vector<sharding::RankSpec>& specs_;
  const sharding::Manifest& manifest_;
  const int senders_;
  const size_t slots_;

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  std::vector<std::shared_ptr<coordinator::Channel>> channels_;
  std::deque<coordinator::Mailbox> boxes_;
  uint64_t pings_ = 0;

  std::vector<std::unique_ptr<transport::Transport>> tx_;                   // per sender
  std::vector<std::vector<std::unique_ptr<transport::Connection>>> conns_;  // per sender, per rank
  std::vector<Buffer> bufs_;
  std::vector<std::vector<std::unique_ptr<transport::MemoryRegion>>> regions_;  // per sender, of bufs_
  std::vector<std::vector<size_t>> sizes_;  // per rank, the plan's bucket sizes in plan order
  uint64_t plan_bytes_ = 0;

  std::vector<Packer> packers_;  // one per sender of the overlap probe; the first also packs alone
  uint64_t packs_ = 0;
  PackDeltas deltas_;
  std::unique_ptr<dataplane::DeltaBases> bases_;  // with deltas on: the copies of the version packed before

  std::vector<double> rtt_, pack_, small_, big_, overlap_one_, overlap_many_;
  std::map<size_t, std::vector<double>> process_, process_many_;
  std::map<size_t, uint64_t> process_bytes_;
};

}  // namespace

Result<std::unique_ptr<LinkProbe>> LinkProbe::open(std::vector<ProbeSocket>& ranks, const std::string& transport,
                                                   const sharding::Plan& plan,
                                                   const std::vector<sharding::RankSpec>& specs,
                                                   const sharding::Manifest& manifest, int in_flight,
                                                   const PackDeltas& deltas, int senders) {
  auto p = std::make_unique<Probe>(ranks, plan, specs, manifest, in_flight, deltas, senders);
  FERRY_RETURN_IF_ERROR(p->open(transport));
  return std::unique_ptr<LinkProbe>(std::move(p));
}

}  // namespace ferry::e2e
