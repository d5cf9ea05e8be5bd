defmodule VllmBridge.Runtime.ShmStreamTest do
  @moduledoc """
  Stream chunks in result slots (ext 8) whose consumer pulls them late: a chunk is
  decoded only when its consumer pulls it, so its slot stays lent, unread, for as long
  as the consumer takes. The worker's sweep deletes only slots handed back and idle; a
  lent one waits for its reader, however late. The worker here has short ages (reclaim
  and idle 0.2 s: `VLLM_BRIDGE_SHM_RECLAIM_S`, `VLLM_BRIDGE_SHM_IDLE_S`), so that the
  consumer's wait passes both many times over. Not async: it looks at the node's slot
  directory.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Shm, Tensor}

  @pool :rt_shm_stream
  # Elements of a chunk: 2 MiB of float32, over the 1 MiB threshold.
  @numel 524_288
  @ages 0.2

  setup_all do
    start_pool!(@pool,
      size: 1,
      allow: ["rt_shm"],
      worker_env: [
        python_path([support_dir()]),
        {"VLLM_BRIDGE_SHM_RECLAIM_S", "#{@ages}"},
        {"VLLM_BRIDGE_SHM_IDLE_S", "#{@ages}"}
      ]
    )

    :ok
  end

  setup do
    %{path: dir} = Shm.dir()
    await_idle!(@pool)
    %{dir: dir}
  end

  defp chunk(i),
    do: Tensor.new(:binary.copy(<<i + 0.0::little-float-32>>, @numel), :float32, [@numel])

  # The worker's result slots lent (not handed back), by name.
  defp lent(dir, os_pid),
    do: dir |> File.ls!() |> Enum.filter(&(&1 =~ ~r/\Ar-#{os_pid}-\d+\z/))

  test "chunks pulled long after the reclaim age come whole", %{dir: dir} do
    %{os_pid: os_pid} = hd(workers!(@pool))
    # As many chunks as the worker has result slots: none needs a slot while all are
    # lent, so the reclaim of a write that finds them all lent (its own rule, kept for
    # frames nobody ever decodes) has nothing to do here; only the sweep runs.
    n = 4
    {:ok, s} = VllmBridge.stream({"rt_shm", "chunks"}, [n, @numel], %{}, pool_name: @pool)

    got =
      Enum.map(Stream.with_index(s), fn {t, i} ->
        if i == 0 do
          # The next chunks sit undecoded in this process's mailbox, their slots lent,
          # while the worker's sweep runs many times past both ages.
          wait_until(fn -> length(lent(dir, os_pid)) == 3 end, 30_000, "3 chunks in slots")
          Process.sleep(round(@ages * 1000 * 10))
          assert length(lent(dir, os_pid)) == 3
        end

        t
      end)

    assert got == Enum.map(1..n, &chunk/1)
  end
end
