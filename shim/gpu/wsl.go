package gpu

import (
	"os"
	"path/filepath"
)

// wslNVML is where WSL2 keeps the NVIDIA driver's libraries: the Windows
// driver shares them into the Linux guest, which has no NVIDIA kernel
// module and no /dev/nvidia* nodes, only /dev/dxg (the GPU
// paravirtualisation device).
const wslNVML = "/usr/lib/wsl/lib/libnvidia-ml.so.1"

// nvmlLibrary is the NVML library to load on the host under root: WSL's
// own on a WSL2 guest (/dev/dxg beside it), so that a guest whose loader
// does not list /usr/lib/wsl/lib (ld.wsl.conf removed, a minimal image)
// is still an NVIDIA host, as dstack's shim takes it; "" elsewhere (the
// loader's search).
func nvmlLibrary(root string) string {
	if _, err := os.Stat(filepath.Join(root, "dev", "dxg")); err != nil {
		return ""
	}
	if fi, err := os.Stat(filepath.Join(root, wslNVML)); err != nil || !fi.Mode().IsRegular() {
		return ""
	}
	return wslNVML
}
