#include "bench/transport_bench.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/transport_device.h"
#include "core/buffer.h"
#include "transport/transport.h"

extern char** environ;

namespace ferry {
namespace {

using transport::Clock;
using namespace std::chrono_literals;

double gbps_of(size_t bytes, double seconds) { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }

void print(bool json, const std::string& name, const std::string& device, size_t bytes, double seconds,
           const std::string& baseline, double base_gbps) {
  const double gbps = gbps_of(bytes, seconds);
  const double ratio = base_gbps > 0 ? gbps / base_gbps : 0;
  if (json) {
    fmt::print(
        "{{\"bench\":\"transport\",\"case\":\"{}\",\"device\":\"{}\",\"bytes\":{},\"seconds\":{:.9f},\"gbps\":{:.3f},"
        "\"baseline\":\"{}\",\"baseline_gbps\":{:.3f},\"ratio\":{:.3f}}}\n",
        name, device, bytes, seconds, gbps, baseline, base_gbps, ratio);
  } else {
    fmt::print("transport {:<8} {:<4} {:>12} B {:>10.6f} s {:>8.2f} GB/s  {:<12} {:>8.2f} GB/s  ratio {:.2f}\n", name,
               device, bytes, seconds, gbps, baseline, base_gbps, ratio);
  }
  std::fflush(stdout);
}

// Runs argv with extra environment entries; returns its stdout, or nothing if it failed or ran past
// the deadline (then it is killed).
std::optional<std::string> run_capture(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                                       transport::Deadline deadline, pid_t* background = nullptr) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const auto& kv : env) env_strings.push_back(kv);
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return std::nullopt;
  const int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
  const pid_t pid = fork();
  if (pid < 0) return std::nullopt;
  if (pid == 0) {
    dup2(background ? devnull : fds[1], 1);
    dup2(devnull, 2);
    execvpe(args[0], args.data(), envp.data());
    _exit(127);
  }
  close(fds[1]);
  close(devnull);
  if (background) {
    close(fds[0]);
    *background = pid;
    return std::string();
  }
  std::string out;
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  if (timed_out || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return out;
}

void reap(pid_t pid, transport::Deadline deadline) {
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return;
    }
    std::this_thread::sleep_for(10ms);  // polling a child's exit; nothing to block on portably
  }
}

bool on_path(const std::string& exe) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (access((dir + "/" + exe).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// ucx_perftest tag_bw between two processes on loopback; GB/s or 0 when it cannot run. Without -e
// (peer error handling), as ferry's ucx endpoints to a peer on the same host: with it, UCX 1.13
// would use only its tcp transport on one host.
double ucx_perftest_gbps(const std::string& tls, size_t bytes, int iters) {
  if (!on_path("ucx_perftest")) return 0;
  const std::string port = std::to_string(20000 + getpid() % 20000);
  std::vector<std::string> env;
  if (!tls.empty()) env.push_back("UCX_TLS=" + tls);
  std::vector<std::string> common = {"-t", "tag_bw", "-s", std::to_string(bytes), "-n", std::to_string(iters),
                                     "-p", port};
  std::vector<std::string> server = {"ucx_perftest"};
  server.insert(server.end(), common.begin(), common.end());
  pid_t spid = -1;
  if (!run_capture(server, env, Clock::now() + 120s, &spid)) return 0;
  std::vector<std::string> client = {"ucx_perftest", "127.0.0.1"};
  client.insert(client.end(), common.begin(), common.end());
  std::optional<std::string> out;
  // The server needs a moment to listen; the client fails fast until it does.
  for (int attempt = 0; attempt < 50 && !out; ++attempt) out = run_capture(client, env, Clock::now() + 120s);
  reap(spid, Clock::now() + 10s);
  if (!out) return 0;
  const size_t at = out->rfind("Final:");
  if (at == std::string::npos) return 0;
  std::stringstream ss(out->substr(at + 6));
  double v[6] = {};
  for (double& x : v) ss >> x;
  return v[5] * 1024.0 * 1024.0 / 1e9;  // overall bandwidth, MB/s (2^20 bytes)
}

double mpi_gbps(const std::string& transport, size_t bytes, int iters) {
#if defined(FERRY_MPI_SENDRECV)
  if (!on_path("mpirun") || bytes > 0x7fffffff) return 0;
  std::vector<std::string> argv = {"mpirun", "-np", "2", "--oversubscribe"};
  if (geteuid() == 0) argv.push_back("--allow-run-as-root");
  if (transport == "tcp") argv.insert(argv.end(), {"--mca", "pml", "ob1", "--mca", "btl", "tcp,self"});
  if (transport == "shm") argv.insert(argv.end(), {"--mca", "pml", "ob1", "--mca", "btl", "vader,self"});
  argv.insert(argv.end(), {FERRY_MPI_SENDRECV, std::to_string(bytes), std::to_string(iters)});
  auto out = run_capture(argv, {}, Clock::now() + 300s);
  if (!out) return 0;
  const size_t at = out->find("seconds ");
  if (at == std::string::npos) return 0;
  return gbps_of(bytes, std::atof(out->c_str() + at + 8));
#else
  (void)transport, (void)bytes, (void)iters;
  return 0;
#endif
}

double memcpy_seconds(size_t bytes, int iters) {
  auto a = Buffer::allocate(bytes);
  auto b = Buffer::allocate(bytes);
  if (!a.ok() || !b.ok()) return 0;
  std::memset(a->data(), 1, bytes);
  std::memset(b->data(), 2, bytes);
  std::memcpy(b->data(), a->data(), bytes);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) std::memcpy(b->data(), a->data(), bytes);
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
}

using bench::Placement;

Result<double> transport_seconds(const std::string& name, size_t bytes, int iters, const Placement& at) {
  FERRY_ASSIGN_OR_RETURN(const Settings settings, load_settings());
  transport::TransportOptions options = transport::transport_options(settings);
  // Buckets of this size must fit the receiver's bound and the shm slots: size them for the run.
  if (settings.source("FERRY_BUCKET_BYTES") == SettingSource::kDefault) options.bucket_bytes = bytes;
  if (at.device) FERRY_RETURN_IF_ERROR(bench::set_device(at.rx));
  FERRY_ASSIGN_OR_RETURN(auto rx, transport::create_transport(name, options));
  if (at.device) FERRY_RETURN_IF_ERROR(bench::set_device(at.tx));
  FERRY_ASSIGN_OR_RETURN(auto tx, transport::create_transport(name, options));
  std::mutex mu;
  std::condition_variable cv;
  int received = 0;
  FERRY_ASSIGN_OR_RETURN(std::string blob, rx->listen(
                                               [&](const transport::ReceivedBucket&) {
                                                 std::lock_guard<std::mutex> lock(mu);
                                                 ++received;
                                                 cv.notify_all();
                                                 return ok_status();
                                               },
                                               [](const Status&) {}, nullptr));
  const auto deadline = Clock::now() + 600s;
  FERRY_ASSIGN_OR_RETURN(auto conn, tx->connect(blob, Clock::now() + 30s, {}));
  constexpr int kInFlight = 2;
  std::vector<Buffer> bufs;
  std::vector<std::unique_ptr<transport::MemoryRegion>> regions;
  for (int k = 0; k < kInFlight; ++k) {
    const Device dev = at.device ? Device::cuda(at.tx) : Device::cpu();
    FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(std::max<size_t>(bytes, 1), dev));
    if (at.device) FERRY_RETURN_IF_ERROR(bench::fill_device(b.data(), b.size(), k + 1, at.tx));
    else std::memset(b.data(), k + 1, b.size());
    FERRY_ASSIGN_OR_RETURN(auto r, tx->register_memory(b.data(), b.size(), dev));
    bufs.push_back(std::move(b));
    regions.push_back(std::move(r));
  }
  auto run = [&](int n) -> Status {
    std::deque<std::unique_ptr<transport::TransferHandle>> pending;
    int target;
    {
      std::lock_guard<std::mutex> lock(mu);
      target = received + n;
    }
    for (int i = 0; i < n; ++i) {
      if (pending.size() == kInFlight) {
        FERRY_RETURN_IF_ERROR(pending.front()->wait(deadline));
        pending.pop_front();
      }
      FERRY_ASSIGN_OR_RETURN(auto h, conn->post(*regions[static_cast<size_t>(i % kInFlight)], 0, bytes));
      pending.push_back(std::move(h));
    }
    for (auto& h : pending) FERRY_RETURN_IF_ERROR(h->wait(deadline));
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_until(lock, deadline, [&] { return received >= target; })) {
      return Status::deadline_exceeded("receiver did not get every bucket");
    }
    return ok_status();
  };
  // Warm-up: connection set-up, and first touch of the pages of every bucket that can be in flight
  // at once (a receiver may need that many buffers).
  FERRY_RETURN_IF_ERROR(run(kInFlight));
  const auto t0 = Clock::now();
  FERRY_RETURN_IF_ERROR(run(iters));
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  conn.reset();
  tx->shutdown();
  rx->shutdown();
  return seconds;
}

}  // namespace

int run_transport_bench(const std::string& transport, size_t bytes, int iters, bool json) {
  if (iters <= 0 || bytes == 0) {
    fmt::print(stderr, "bench transport: bytes and iterations must be positive\n");
    return 1;
  }
  auto placed = bench::place(transport);
  if (!placed.ok()) {
    fmt::print(stderr, "bench transport {}: {}\n", transport, placed.status().to_string());
    return 1;
  }
  const Placement at = *placed;
  if (at.device) {
    fmt::print(stderr, "bench transport {}: sender on cuda:{}, receiver on cuda:{}\n", transport, at.tx, at.rx);
  }
  auto seconds = transport_seconds(transport, bytes, iters, at);
  if (!seconds.ok()) {
    fmt::print(stderr, "bench transport {}: {}\n", transport, seconds.status().to_string());
    return 1;
  }
  if (at.device) {
    auto baseline = [&](const char* name, Result<double> s) {
      if (s.ok()) {
        print(json, transport, "cuda", bytes, *seconds, name, gbps_of(bytes, *s));
      } else {
        fmt::print(stderr, "bench transport {}: baseline {} left out: {}\n", transport, name, s.status().to_string());
      }
    };
    baseline("device_copy", bench::device_copy_seconds(bytes, iters, at.tx, at.rx));
    baseline("nccl", bench::nccl_sendrecv_seconds(bytes, iters, at.tx, at.rx));
    return 0;
  }
  print(json, transport, "cpu", bytes, *seconds, "memcpy", gbps_of(bytes, memcpy_seconds(bytes, iters)));
  std::string tls;
  if (transport == "tcp") tls = "tcp";
  if (transport == "shm") tls = "sm,self";
  // For ucx, like with like: the bench's two ends are on one host, where the transport's endpoints
  // go without peer error handling (UCX picks shared memory and cma), and so do perftest's (no -e).
  if (const double g = ucx_perftest_gbps(tls, bytes, iters); g > 0) {
    print(json, transport, "cpu", bytes, *seconds, "ucx_perftest", g);
  }
  if (const double g = mpi_gbps(transport, bytes, iters); g > 0) {
    print(json, transport, "cpu", bytes, *seconds, "mpi", g);
  }
  return 0;
}

}  // namespace ferry
