// The entry points of one variant of exact mode's kernels, declared: exact_isa.h defines them (in each variant's
// file, under its own target) and exact_kernels.cpp binds them to Python. Included inside the variant's namespace
// (isa_<variant>) in both. A definition that parts from its declaration is an overload of its own: the declared
// function is then missing from the build, and loading the extension fails (an undefined symbol), never a call.
// Arguments and results as exact_isa.h describes them at each definition.

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);
at::Tensor linear_sums(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& init);
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& visible, double scaling);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu(const at::Tensor& x);
int64_t stream(const std::vector<at::Tensor>& tensors);
std::vector<at::Tensor> choices(const at::Tensor& logits, int64_t n, bool with_probs);
std::vector<at::Tensor> layer_in(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& norm_w, double eps, const std::vector<at::Tensor>& packed,
                                 const std::vector<at::Tensor>& bias, const std::vector<int64_t>& n,
                                 const at::Tensor& q_norm_w, const at::Tensor& k_norm_w, double qk_eps,
                                 int64_t head_dim);
at::Tensor layer_out(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& visible, double scaling, const std::vector<at::Tensor>& packed,
                     const std::vector<at::Tensor>& bias, const std::vector<int64_t>& n, const at::Tensor& norm_w,
                     double eps);

// speed only (the bits never change): which path bf16 products take, tall blocks, AMX tiles from how many rows
bool choose_bf16_path();
std::vector<double> product_rates();
bool bf16_widened();
bool set_widen_bf16(bool on);
bool set_tall_blocks(bool on);
int64_t amx_min_rows();
int64_t set_amx_rows(int64_t rows);
bool set_tile_emulation(bool on);
// the layer stack's linear steps, for tests: its last thread waits `microseconds` before each one (the others
// take its panels); the last forward's [threads, panels run, panels taken from another thread's share]
int64_t set_stack_stall(int64_t microseconds);
std::vector<int64_t> stack_counts();

// Every decoder layer of one forward in one call (exact_isa.h, "the layer stack").
struct Stack {
  struct Layer {
    at::Tensor norm_in, q_norm, k_norm, norm_out;
    double eps_in, qk_eps, scaling, eps_out;
    int64_t head_dim;
    std::vector<at::Tensor> packed_in, bias_in, packed_out, bias_out;
    std::vector<int64_t> n_in, n_out;
  };
  std::vector<Layer> layers;
  bool tiled = false;  // some packed weight is in AMX's tile layout (`tile_layout`)

  // layer_in's arguments after cos/sin, the attention scaling, then layer_out's after the visibility
  void add(const at::Tensor& norm_in, double eps_in, const std::vector<at::Tensor>& packed_in,
           const std::vector<at::Tensor>& bias_in, const std::vector<int64_t>& n_in, const at::Tensor& q_norm,
           const at::Tensor& k_norm, double qk_eps, int64_t head_dim, double scaling,
           const std::vector<at::Tensor>& packed_out, const std::vector<at::Tensor>& bias_out,
           const std::vector<int64_t>& n_out, const at::Tensor& norm_out, double eps_out);

  // x [m, hidden] at positions with cos/sin [m, d]; visible [m, n + m]; keys/values: one buffer [1, kv, cap, d]
  // per layer, cap >= n + m, holding the cache's n positions. Returns the last layer's output [m, hidden], or with
  // `norm` (a weight [hidden], and its epsilon) that output through the model's final RMSNorm (`rms_norm`'s bits).
  // tiles: each layer's key tiles [kv, tiles >= (n + m) / 16, steps, 16] int32 (`write_tile`), valid for its first
  // `valid` positions: the rest up to n are made from the cache's keys, the m new rows' written.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& visible,
                     const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const std::vector<at::Tensor>& tiles, const std::vector<int64_t>& valid, int64_t n,
                     const c10::optional<at::Tensor>& norm, double norm_eps) const;
  // a fused forward: the first `verify` rows through these layers (the AR view), the rest through `draft`'s
  // attention projections and q/k norms (the draft view) and these layers' norms and MLP; `forward`'s other arguments
  at::Tensor forward_views(const Stack& draft, int64_t verify, const at::Tensor& x, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& visible, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values, const std::vector<at::Tensor>& tiles,
                           const std::vector<int64_t>& valid, int64_t n, const c10::optional<at::Tensor>& norm,
                           double norm_eps) const;

 private:
  at::Tensor run(const Stack* draft, int64_t verify, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& visible, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                 const std::vector<at::Tensor>& tiles, const std::vector<int64_t>& valid, int64_t n,
                 const c10::optional<at::Tensor>& norm, double norm_eps) const;
};
