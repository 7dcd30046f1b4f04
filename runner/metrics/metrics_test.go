package metrics

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func write(t *testing.T, root, rel, data string) {
	t.Helper()
	p := filepath.Join(root, rel)
	_ = os.MkdirAll(filepath.Dir(p), 0o755)
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCollectV2AndV1AndGPU(t *testing.T) {
	v2 := t.TempDir()
	write(t, v2, "proc/self/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n")
	write(t, v2, "proc/self/cgroup", "0::/\n")
	write(t, v2, "cg/cpu.stat", "usage_usec 123456\nuser_usec 1\n")
	write(t, v2, "cg/memory.current", "1000000\n")
	write(t, v2, "cg/memory.stat", "anon 5\ninactive_file 250000\n")
	smi := filepath.Join(v2, "nvidia-smi")
	write(t, v2, "nvidia-smi", "#!/bin/sh\necho '1024, 87'\necho '0, 0'\n")
	_ = os.Chmod(smi, 0o755)
	c := New(Config{ProcRoot: filepath.Join(v2, "proc"), CgroupRoot: filepath.Join(v2, "cg"), Root: v2, NvidiaSMI: smi}, nil, nil)
	m, err := c.Collect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if m.CPUUsageMicro != 123456 || m.MemoryUsageBytes != 1000000 || m.MemoryWorkingSetBytes != 750000 || len(m.GPUs) != 2 ||
		m.GPUs[0].GPUMemoryUsageBytes != 1<<30 || m.GPUs[0].GPUUtilPercent != 87 {
		t.Fatalf("v2: %+v", m)
	}

	v1 := t.TempDir()
	write(t, v1, "proc/self/mounts", "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n")
	write(t, v1, "proc/self/cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
	write(t, v1, "cg/cpu,cpuacct/cpuacct.usage", "5000000000\n")
	write(t, v1, "cg/memory/memory.usage_in_bytes", "2048\n")
	write(t, v1, "cg/memory/memory.stat", "total_inactive_file 48\n")
	c = New(Config{ProcRoot: filepath.Join(v1, "proc"), CgroupRoot: filepath.Join(v1, "cg"), Root: v1, NvidiaSMI: "/nonexistent"}, nil, nil)
	m, err = c.Collect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if m.CPUUsageMicro != 5000000 || m.MemoryUsageBytes != 2048 || m.MemoryWorkingSetBytes != 2000 || m.GPUs == nil || len(m.GPUs) != 0 {
		t.Fatalf("v1: %+v", m)
	}

	none := t.TempDir()
	write(t, none, "proc/self/mounts", "proc /proc proc rw 0 0\n")
	write(t, none, "proc/self/cgroup", "")
	if _, err := New(Config{ProcRoot: filepath.Join(none, "proc"), Root: none}, nil, nil).Collect(context.Background()); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("no cgroups: %v", err)
	}
}
