defmodule VllmBridge.Pool.Meta do
  @moduledoc false
  # What a caller needs to know of a pool, read from `VllmBridge.Pool.Directory` on every
  # call: its size, its slot counters (`VllmBridge.Pool.Slots`), the in-flight bound per
  # worker, the frame limit (`max_frame_bytes`), the queue process and its bound, and
  # `started`: one atomic, 0 while `VllmBridge.Pool.start/2` waits for the workers' first
  # start, 1 once it returned (a worker whose first start fails is then not restarted:
  # `VllmBridge.Worker.Starting`), and `starts`: per worker index, how many times a worker
  # process began a start (its restarts are one less; `VllmBridge.Pool.status/1`), and
  # `shm`: per worker index, 1 when its worker said in its hello that it reads this node's
  # slot directory (`VllmBridge.Shm.mark/3`; 0 while it starts).

  @enforce_keys [:name, :size, :slots, :max_in_flight, :max_frame_bytes, :queue_size]
  defstruct [
    :name,
    :size,
    :slots,
    :max_in_flight,
    :max_frame_bytes,
    :queue_size,
    :queue,
    :started,
    :starts,
    :shm
  ]

  @type t :: %__MODULE__{
          name: term(),
          size: pos_integer(),
          slots: :atomics.atomics_ref(),
          max_in_flight: pos_integer(),
          max_frame_bytes: pos_integer(),
          queue_size: non_neg_integer(),
          queue: pid() | nil,
          started: :atomics.atomics_ref() | nil,
          starts: :atomics.atomics_ref() | nil,
          shm: :atomics.atomics_ref() | nil
        }
end
