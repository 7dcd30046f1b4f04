package testenv

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"
)

// NvidiaToolkitVersion is the NVIDIA container toolkit the tests build;
// scripts/gpu-kit.sh packs the same version (NCT_VERSION) for GPU machines.
const NvidiaToolkitVersion = "v1.20.2"

// NvidiaToolkit returns a directory holding NVIDIA's nvidia-container-runtime
// and nvidia-ctk, built from the toolkit's Go module (through the module
// proxy) once per machine and kept under the temp dir, by version. A build
// that fails fails the test: the module proxy is part of the test set-up.
func NvidiaToolkit(t testing.TB) string {
	t.Helper()
	return machineCache(t, "tandem-nvidia-toolkit-"+NvidiaToolkitVersion, func(dir string) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		mod := "github.com/NVIDIA/nvidia-container-toolkit/cmd/"
		cmd := exec.CommandContext(ctx, goTool(), "install", "-trimpath",
			mod+"nvidia-container-runtime@"+NvidiaToolkitVersion, mod+"nvidia-ctk@"+NvidiaToolkitVersion)
		cmd.Env = append(os.Environ(), "GOBIN="+dir, "GOFLAGS=", "CGO_CFLAGS=-O2 -Wno-deprecated-declarations")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build NVIDIA's container toolkit %s: %v\n%s", NvidiaToolkitVersion, err, tail(out, 20))
		}
	})
}

// goTool is the go command on PATH, else the usual install's.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return "/usr/local/go/bin/go"
}
