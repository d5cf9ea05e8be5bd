defmodule VllmBridge.Runtime do
  @moduledoc """
  The runtime options of one call (`__runtime__:` in the generated bindings), resolved
  once when the call enters the bridge.

  | option | values | default |
  |---|---|---|
  | `:timeout` | ms (an integer from 0 to 4 294 967 295, about 49 days) or `:infinity` | the profile's |
  | `:timeout_profile` | `:default`, `:ml_inference`, `:batch_job`, `:streaming` | `:default` |
  | `:stream_timeout` | ms (as `:timeout`) or `:infinity` | the profile's |
  | `:session_id` | a session id (string), a `%VllmBridge.Session{}`, or `nil` | the process's current session (`VllmBridge.Session.current/0`), else `nil` |
  | `:pool_name` | the name of a started pool | `:default` |
  | `:affinity` | `:hint`, `:strict_queue`, `:strict_fail_fast` | `:strict_queue` |
  | `:node` | a node name (atom): `node()` for this node, or a connected node; `nil` | `nil`: this node's pool if it has one, else a node that has it |

  Profiles (`timeout` / `stream_timeout`): `:default` 120 000 / 1 800 000,
  `:ml_inference` 600 000 / 1 800 000, `:batch_job` `:infinity` / `:infinity`,
  `:streaming` 120 000 / 1 800 000.

  Precedence for `timeout` (and likewise `stream_timeout`): the call's own `:timeout`, then
  the profile the call names, then `config :vllm_bridge, runtime: [timeout: ...]`, then the
  configured profile (`config :vllm_bridge, runtime: [timeout_profile: ...]`, default
  `:default`). Every other option falls back to the same `:runtime` config, then to the
  table's default.

  **One deadline.** The call's deadline is fixed (monotonic ms) from the moment it
  runs: `timeout` for a call, `stream_timeout` for a stream (the whole stream). Time spent
  queued comes out of it, and the worker is told the milliseconds left when the request
  is sent.

  **Affinity** says where a call in a session may run (see `VllmBridge.Session`):
  `:strict_queue` waits its turn on the session's worker; `:strict_fail_fast` runs only
  when that worker is idle (nothing running or queued on it, whatever `max_in_flight`
  is) and is `:pool_busy` at once otherwise; `:hint` runs there when it is idle and else
  on the least loaded worker with room. The default is `:strict_queue`, not `:hint`: a
  call such as `get_forward_context()` reads session state without carrying any, and
  only the caller knows that; `:hint` is an opt-in for calls known to be state-free.

  **Nodes.** A pool started on another connected BEAM node is found by its name (see
  `VllmBridge.Pool.nodes/1`): `pool_name: :gpu` runs on this node when it has a pool
  `:gpu`, and otherwise on a node that has one (picked at random among them, call by
  call). `node:` pins the node (`node: node()` means this one, never another). A
  session, a context handle or a reference belongs to the node its worker is on, and
  its requests run there whatever `pool_name:` says; a `node:` naming another node is
  refused. Deadlines, cancels and errors are the same as on one node (see `VllmBridge`,
  "Across nodes").

  Unknown options and bad values are refused with `{:error, %VllmBridge.Error{type:
  :bad_argument}}` naming them.
  """

  @typedoc "Milliseconds, or `:infinity`."
  @type ms :: non_neg_integer() | :infinity

  @typedoc "Runtime options as a caller writes them (the table above)."
  @type opts :: [
          timeout: ms(),
          timeout_profile: atom(),
          stream_timeout: ms(),
          session_id: String.t() | VllmBridge.Session.t() | nil,
          pool_name: term(),
          affinity: :hint | :strict_queue | :strict_fail_fast,
          node: node() | nil
        ]

  @doc "The option names a call accepts."
  @spec keys() :: [atom()]
  def keys,
    do: [:timeout, :timeout_profile, :stream_timeout, :session_id, :pool_name, :affinity, :node]

  @doc "The timeout profiles: name => `{timeout, stream_timeout}`."
  @spec profiles() :: %{atom() => {ms(), ms()}}
  def profiles,
    do: %{
      default: {120_000, 1_800_000},
      ml_inference: {600_000, 1_800_000},
      batch_job: {:infinity, :infinity},
      streaming: {120_000, 1_800_000}
    }

  @doc "The values of `:affinity`."
  @spec affinities() :: [atom()]
  def affinities, do: [:hint, :strict_queue, :strict_fail_fast]
end
