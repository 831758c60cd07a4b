// The demo model as ferry's Llama description; shared by ferry-demo and the mpirun example.
#pragma once

#include "examples/demo/reference.h"
#include "sharding/llama.h"

namespace demo {

inline ferry::sharding::LlamaConfig llama_config(const Model& m) {
  ferry::sharding::LlamaConfig c;
  c.hidden_size = m.hidden;
  c.num_heads = m.heads;
  c.num_kv_heads = m.kv_heads;
  c.intermediate_size = m.intermediate;
  c.vocab_size = m.vocab;
  c.num_layers = m.layers;
  c.vocab_pad_multiple = m.vocab_pad;
  return c;
}

}  // namespace demo
