// ferry-tiny-decoder: loads random weights A into registered storage through the reload engine,
// captures the decode step, generates greedily, updates the engine to weights B in place and
// generates again from the same captured program; prints census, audit and the flip probe.
//
//   ferry-tiny-decoder [--scheme gptq_int4] [--tokens 8]
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "examples/tiny_decoder/decoder.h"
#include "reload/checkpoint_loader.h"
#include "reload/flip_probe.h"

namespace {

ferry::Status run(const std::string& scheme, int tokens) {
  const tiny::Config cfg;
  FERRY_ASSIGN_OR_RETURN(const ferry::Scheme linear, ferry::parse_scheme(scheme));
  FERRY_ASSIGN_OR_RETURN(auto spec, tiny::rank_spec(cfg, linear));
  FERRY_ASSIGN_OR_RETURN(auto storage, ferry::reload::ModelStorage::allocate(spec, ferry::Device::cpu()));
  FERRY_ASSIGN_OR_RETURN(auto engine, ferry::reload::ReloadEngine::create(spec, storage));
  FERRY_ASSIGN_OR_RETURN(auto a, tiny::Weights::random(cfg, spec, 1));
  FERRY_ASSIGN_OR_RETURN(auto b, tiny::Weights::random(cfg, spec, 2));
  FERRY_ASSIGN_OR_RETURN(auto report, ferry::reload::load_checkpoint(*engine, a.checkpoint(), 1));
  FERRY_ASSIGN_OR_RETURN(auto decoder, tiny::Decoder::create(cfg, spec, engine->registry()));
  const std::vector<int32_t> prompt{1, 17, 42, 7};
  FERRY_ASSIGN_OR_RETURN(auto out_a, decoder->generate(prompt, tokens));
  fmt::print("{}: v1 {} census {} tokens {}\n", scheme, ferry::reload::audit(decoder->program(), engine->registry(),
                                                                             storage.tensors()).to_string(),
             report.census.to_string(), out_a);
  FERRY_ASSIGN_OR_RETURN(report, ferry::reload::load_checkpoint(*engine, b.checkpoint(), 2));
  FERRY_ASSIGN_OR_RETURN(auto out_b, decoder->generate(prompt, tokens));
  fmt::print("{}: v2 {} census {} peak staging {} B, tokens {}\n", scheme,
             ferry::reload::audit(decoder->program(), engine->registry(), storage.tensors()).to_string(),
             report.census.to_string(), report.peak_staging_bytes, out_b);
  auto targets = ferry::reload::permutation_tensors(engine->registry());
  if (targets.empty()) targets = ferry::reload::scale_tensors(engine->registry());
  if (!targets.empty()) {
    FERRY_ASSIGN_OR_RETURN(auto flip, ferry::reload::flip_probe(engine->registry(), targets,
                                                                [&] { return decoder->outputs(prompt, tokens); }));
    fmt::print("{}: {}\n", scheme, flip.to_string());
    if (!flip.changed) return ferry::Status::internal("the flip probe did not change the outputs");
  }
  return ferry::ok_status();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry tiny decoder: reload in place under a captured decode step"};
  std::string scheme = "gptq_int4";
  int tokens = 8;
  app.add_option("--scheme", scheme, "quantization scheme of the linear layers");
  app.add_option("--tokens", tokens, "tokens to generate");
  CLI11_PARSE(app, argc, argv);
  const ferry::Status st = run(scheme, tokens);
  if (!st.ok()) {
    std::cerr << st.to_string() << "\n";
    return 1;
  }
  return 0;
}
