// Child processes for fault tests: spawn, stop, kill, and await exit with a deadline.
#pragma once

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

extern char** environ;

namespace ferry::testutil {

class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0) pid_ = -1;
    if (pid_ > 0) pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      wait_exit(10'000);
    }
    if (pidfd_ >= 0) close(pidfd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  bool ok() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  void signal(int sig) { ::kill(pid_, sig); }
  // Blocks until the child stops itself (SIGSTOP); false if it exited instead.
  bool wait_stopped() {
    int status = 0;
    if (waitpid(pid_, &status, WUNTRACED) != pid_) return false;
    if (WIFSTOPPED(status)) return true;
    reaped_ = true;
    return false;
  }
  // Exit status (128+signal when killed), or -1 if it did not exit within `ms`.
  int wait_exit(int ms) {
    if (reaped_) return exit_;
    if (pidfd_ >= 0) {
      pollfd p{pidfd_, POLLIN, 0};
      if (poll(&p, 1, ms) == 0) return -1;
    }
    int status = 0;
    if (waitpid(pid_, &status, 0) != pid_) return -1;
    reaped_ = true;
    exit_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return exit_;
  }

 private:
  pid_t pid_ = -1;
  int pidfd_ = -1;
  bool reaped_ = false;
  int exit_ = -1;
};

}  // namespace ferry::testutil
