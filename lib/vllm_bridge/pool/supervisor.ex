defmodule VllmBridge.Pool.Supervisor do
  @moduledoc false
  # The supervisor of one pool: its queue (`VllmBridge.Pool.Queue`, which publishes the
  # pool in the directory) and its workers (`VllmBridge.Worker`, `:permanent`, one per
  # index). A worker whose Python process dies is started again by this supervisor, with
  # the same index and environment. The slot counters live as long as the pool.
  use Supervisor

  alias VllmBridge.Pool.{Meta, Queue, Slots}

  @doc false
  @spec start_link({term(), keyword()}) :: Supervisor.on_start()
  def start_link({name, opts}) do
    Supervisor.start_link(__MODULE__, {name, opts}, name: via(name))
  end

  @doc false
  @spec child_spec({term(), keyword()}) :: Supervisor.child_spec()
  def child_spec({name, opts}) do
    %{
      id: {__MODULE__, name},
      start: {__MODULE__, :start_link, [{name, opts}]},
      type: :supervisor,
      restart: :temporary
    }
  end

  @doc "The registered name of pool `name`'s supervisor."
  @spec via(term()) :: {:via, Registry, {VllmBridge.Pool.Names, term()}}
  def via(name), do: {:via, Registry, {VllmBridge.Pool.Names, name}}

  @impl true
  def init({name, opts}) do
    size = opts[:size]

    meta = %Meta{
      name: name,
      size: size,
      slots: Slots.new(size),
      max_in_flight: opts[:max_in_flight],
      max_frame_bytes: opts[:max_frame_bytes],
      queue_size: opts[:queue_size],
      started: :atomics.new(1, signed: false),
      starts: :atomics.new(size, signed: false),
      shm: :atomics.new(size, signed: false)
    }

    worker_opts =
      Keyword.take(opts, [
        :python,
        :allow,
        :modules,
        :max_refs,
        :poll_us,
        :start_timeout,
        :cancel_grace,
        :shutdown_grace,
        :worker_module,
        :max_frame_bytes,
        :on_start,
        :log_level,
        :progress
      ])

    workers =
      for i <- 0..(size - 1) do
        {VllmBridge.Worker,
         worker_opts ++ [pool: name, index: i, meta: meta, env: Enum.at(opts[:envs], i)]}
      end

    Supervisor.init([{Queue, meta} | workers],
      strategy: :one_for_one,
      max_restarts: opts[:max_restarts],
      max_seconds: opts[:max_seconds]
    )
  end
end
