// Package hostinfo collects the host facts of <shim home>/host_info.json,
// which SSH-fleet onboarding reads to build the instance offer.
package hostinfo

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"syscall"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/atomicfile"
	"github.com/tandem-run/tandem/shim/gpu"
)

// Collect gathers the facts. diskPath is a path on the filesystem holding
// Docker's root dir.
func Collect(gpus []gpu.GPU, diskPath string) (api.HostInfo, error) {
	info := api.HostInfo{GPUVendor: api.GPUVendorNone, GPUCount: len(gpus), CPUs: runtime.NumCPU(), Addresses: []string{}}
	if len(gpus) > 0 {
		info.GPUVendor, info.GPUName, info.GPUMemory = gpus[0].Vendor, gpus[0].Name, api.MiB(gpus[0].MemoryMiB)
	}
	// Each part on its own: one that cannot be read is left zero and said
	// in the error, the rest is still the host's.
	var errs []error
	var si syscall.Sysinfo_t
	if err := syscall.Sysinfo(&si); err != nil {
		errs = append(errs, fmt.Errorf("sysinfo: %w", err))
	} else {
		info.Memory = uint64(si.Totalram) * uint64(si.Unit)
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(diskPath, &st); err != nil {
		errs = append(errs, fmt.Errorf("statfs %s: %w", diskPath, err))
	} else {
		info.DiskSize = st.Bavail * uint64(st.Bsize)
	}
	if addrs, err := Addresses(); err != nil {
		errs = append(errs, err)
	} else {
		info.Addresses = addrs
	}
	return info, errors.Join(errs...)
}

// Addresses lists the host's non-loopback interface addresses in CIDR form
// ("10.0.0.5/24"), interfaces in the kernel's order.
func Addresses() ([]string, error) {
	ifaces, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("interfaces: %w", err)
	}
	out := []string{}
	for _, ifc := range ifaces {
		if ifc.Flags&net.FlagLoopback != 0 || ifc.Flags&net.FlagUp == 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && !ipn.IP.IsLoopback() {
				out = append(out, ipn.String())
			}
		}
	}
	return out, nil
}

// WriteOnce writes info to path atomically unless the file exists (the
// server deletes it when it wants a fresh one). It reports whether it wrote.
func WriteOnce(path string, info api.HostInfo) (bool, error) {
	if _, err := os.Stat(path); err == nil {
		return false, nil
	}
	b, err := json.Marshal(info)
	if err != nil {
		return false, fmt.Errorf("encode host info: %w", err)
	}
	if err := atomicfile.WriteBytes(path, b, atomicfile.Options{Perm: 0o644, UID: -1}); err != nil {
		return false, fmt.Errorf("host info: %w", err)
	}
	return true, nil
}
