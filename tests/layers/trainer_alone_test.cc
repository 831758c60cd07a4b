// The trainer's face linked from ferry_trainer alone (no receive end, no reload engine): it embeds
// its coordinator and answers where that coordinator listens.
#include <gtest/gtest.h>

#include "coordinator/trainer.h"

namespace ferry {
namespace {

TEST(TrainerAlone, EmbedsItsCoordinatorWithoutTheReloadEngine) {
  coordinator::TrainerOptions options;
  options.listen_host = "127.0.0.1";
  auto trainer = coordinator::Trainer::create(options);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  EXPECT_FALSE((*trainer)->coordinator_address().empty());
}

}  // namespace
}  // namespace ferry
