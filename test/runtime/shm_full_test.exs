defmodule VllmBridge.Runtime.ShmFullTest do
  @moduledoc """
  A slot directory on a file system too small for a large tensor (Docker gives /dev/shm
  64 MiB): the write fails at once (its pages are allocated before anything is copied),
  the tensor takes the pipe, and so does every large tensor for a while, said once in
  the log. Needs a tmpfs of its own (mount, as root): skipped with the reason otherwise.
  Not async: it gives the node another slot directory while it runs.
  """
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Shm, Tensor}

  @diag "vllm_bridge.bridge.diag"

  mnt = Path.join(System.tmp_dir!(), "vb_shm_full_#{System.pid()}")
  File.mkdir_p!(mnt)

  case System.cmd("mount", ["-t", "tmpfs", "-o", "size=1536k", "tmpfs", mnt],
         stderr_to_stdout: true
       ) do
    {_, 0} ->
      System.cmd("umount", [mnt])
      @mnt mnt

    {out, _} ->
      @moduletag skip: "cannot mount a small tmpfs here (#{String.trim(out)})"
      @mnt mnt
  end

  setup_all do
    {_, 0} = System.cmd("mount", ["-t", "tmpfs", "-o", "size=1536k", "tmpfs", @mnt])
    previous = Application.fetch_env(:vllm_bridge, :shm_dir)
    restart_shm = fn -> :ok = Supervisor.terminate_child(VllmBridge.Supervisor, Shm) end
    restart_shm.()
    Application.put_env(:vllm_bridge, :shm_dir, @mnt)
    {:ok, _} = Supervisor.restart_child(VllmBridge.Supervisor, Shm)

    on_exit(fn ->
      restart_shm.()

      case previous do
        {:ok, v} -> Application.put_env(:vllm_bridge, :shm_dir, v)
        :error -> Application.delete_env(:vllm_bridge, :shm_dir)
      end

      {:ok, _} = Supervisor.restart_child(VllmBridge.Supervisor, Shm)
      System.cmd("umount", [@mnt])
      File.rm_rf(@mnt)
    end)

    start_pool!(:rt_shm_full, size: 1)
    :ok
  end

  test "a tensor larger than the room left takes the pipe, said once" do
    %{path: dir} = Shm.dir()
    assert String.starts_with?(dir, @mnt)
    size = 2 * 1_048_576

    log =
      capture_log(fn ->
        for seed <- 1..3 do
          t = Tensor.new(:binary.copy(<<seed>>, size), :uint8, [size])
          assert {:ok, ^t} = VllmBridge.call({@diag, "echo"}, [t], %{}, pool_name: :rt_shm_full)
        end
      end)

    assert length(String.split(log, "the file system is full")) == 2, log
    # Nothing is left behind by the failed writes.
    wait_until(fn -> not Enum.any?(File.ls!(dir), &(&1 =~ ~r/\Ae-\d+\z/)) end, 15_000, "settled")
  end
end
