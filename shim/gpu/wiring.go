package gpu

import (
	"cmp"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// This file owns how a container reaches its GPUs, both ways: Wire encodes
// a task's GPUs for container creation, IDsFromContainer decodes them back
// from what Docker reports (recovery after a shim restart). Vendor
// knowledge lives here only; the task engine and the Docker runtime map
// these neutral shapes to their own types.

// NVIDIACapabilities are the driver capabilities a task gets (dstack's).
// "display" needs /dev/nvidia-modeset, absent on headless hosts: see
// WithoutDisplay.
var NVIDIACapabilities = []string{"gpu", "utility", "compute", "graphics", "video", "display", "compat32"}

// cdiPrefix names an NVIDIA GPU as a CDI device.
const cdiPrefix = cdiKind + "="

// amdRender is the device-node prefix of AMD GPUs (their ids).
const amdRender = "/dev/dri/renderD"

// Request is an NVIDIA device request: the runtime hook (Driver "") with
// UUIDs and capabilities, or CDI (Driver "cdi") with CDI device names.
type Request struct {
	Driver       string
	DeviceIDs    []string
	Capabilities []string
}

// Device is a device node mapped into a container.
type Device struct{ Host, Container string }

// Bind is a host path bound into a container at Container.
type Bind struct{ Host, Container string }

// Wiring is what a container needs to see its GPUs.
type Wiring struct {
	Request     *Request // NVIDIA
	Devices     []Device // AMD, Tenstorrent
	Binds       []Bind   // Tenstorrent's 1 GiB hugepages
	Env         []string // Gaudi: NAME=value
	Runtime     string   // Gaudi: Docker's habana runtime
	IpcHost     bool
	CapAdd      []string
	SecurityOpt []string
}

// Host is what wiring reads of the host: where its files are (Root, "/"
// in production; device nodes and hugepages are found there) and whether
// NVIDIA GPUs go as CDI devices.
type Host struct {
	Root string
	CDI  bool
}

// Gaudi and Tenstorrent wiring, as dstack's shim (configureGpus).
const (
	habanaRuntime  = "habana"
	habanaEnv      = "HABANA_VISIBLE_DEVICES"
	ttDevDir       = "/dev/tenstorrent/"
	ttHugepages    = "/dev/hugepages-1G"
	habanaEnvEqual = habanaEnv + "="
)

// Wire encodes ids (GPU UUIDs for NVIDIA, render nodes for AMD) for vendor
// on a host whose root is "/". cdi picks CDI device requests over the
// runtime hook for NVIDIA.
func Wire(vendor api.GPUVendor, ids []string, cdi bool) Wiring {
	return Host{Root: "/", CDI: cdi}.Wire(vendor, ids)
}

// Wire encodes ids for vendor: NVIDIA UUIDs, AMD render nodes, Gaudi
// indices (hl-smi's), Tenstorrent device numbers (/dev/tenstorrent/<id>).
func (h Host) Wire(vendor api.GPUVendor, ids []string) Wiring {
	root := cmp.Or(h.Root, "/")
	switch vendor {
	case api.GPUVendorNVIDIA:
		if h.CDI {
			names := make([]string, 0, len(ids))
			for _, id := range ids {
				names = append(names, cdiPrefix+id)
			}
			return Wiring{Request: &Request{Driver: "cdi", DeviceIDs: names}}
		}
		return Wiring{Request: &Request{DeviceIDs: slices.Clone(ids), Capabilities: slices.Clone(NVIDIACapabilities)}}
	case api.GPUVendorAMD:
		devs := []Device{{Host: "/dev/kfd", Container: "/dev/kfd"}}
		for _, id := range ids {
			devs = append(devs, Device{Host: id, Container: id})
		}
		return Wiring{Devices: devs, IpcHost: true, CapAdd: []string{"SYS_PTRACE"}, SecurityOpt: []string{"seccomp=unconfined"}}
	case api.GPUVendorIntel:
		// The habana runtime mounts the cards the variable names: the
		// indices hl-smi reports.
		return Wiring{Runtime: habanaRuntime, Env: []string{habanaEnvEqual + strings.Join(ids, ",")}, IpcHost: true, CapAdd: []string{"SYS_NICE"}}
	case api.GPUVendorTenstorrent:
		var w Wiring
		for _, id := range ids {
			w.Devices = append(w.Devices, Device{Host: filepath.Join(root, ttDevDir, id), Container: ttDevDir + id})
		}
		// tt-metal maps its host buffers from 1 GiB hugepages when the
		// host has them mounted there (tt-installer's default).
		if fi, err := os.Stat(filepath.Join(root, ttHugepages)); err == nil && fi.IsDir() {
			w.Binds = append(w.Binds, Bind{Host: filepath.Join(root, ttHugepages), Container: ttHugepages})
		}
		return w
	}
	return Wiring{}
}

// WithoutDisplay is r without the display capability (the retry on hosts
// without /dev/nvidia-modeset; dstack issue #4004). nil stays nil.
func WithoutDisplay(r *Request) *Request {
	if r == nil {
		return nil
	}
	out := *r
	out.Capabilities = slices.DeleteFunc(slices.Clone(r.Capabilities), func(c string) bool { return c == "display" })
	return &out
}

// HasDisplay reports whether r asks for the display capability.
func HasDisplay(r *Request) bool { return r != nil && slices.Contains(r.Capabilities, "display") }

// Seen is what Docker reports of a container that says which GPUs it
// holds: its device requests' ids, its mapped devices and its environment.
type Seen struct {
	RequestIDs []string
	Devices    []Device
	Env        []string
	Runtime    string
}

// IDsFromContainer decodes a container's GPU ids from what Docker reports:
// the inverse of Wire for every vendor. A Tenstorrent device counts only
// where its host node and its container node name the same card.
func IDsFromContainer(c Seen) []string {
	var ids []string
	for _, id := range c.RequestIDs {
		ids = append(ids, strings.TrimPrefix(id, cdiPrefix))
	}
	for _, d := range c.Devices {
		switch {
		case strings.HasPrefix(d.Host, amdRender):
			ids = append(ids, d.Host)
		case strings.HasPrefix(d.Container, ttDevDir):
			n := strings.TrimPrefix(d.Container, ttDevDir)
			if ttNumber(n) && strings.HasSuffix(d.Host, ttDevDir+n) {
				ids = append(ids, n)
			}
		}
	}
	// Gaudi: only a container of the habana runtime holds cards (an image
	// may set the variable itself, to "all" or to anything), and of the
	// variable the last value, the shim's own (Wire's env comes last).
	if c.Runtime == habanaRuntime {
		v, found := "", false
		for _, e := range c.Env {
			if val, ok := strings.CutPrefix(e, habanaEnvEqual); ok {
				v, found = val, true
			}
		}
		for _, idx := range strings.Split(v, ",") {
			if n, err := strconv.Atoi(idx); found && err == nil && n >= 0 && n <= 1023 && strconv.Itoa(n) == idx {
				ids = append(ids, idx)
			}
		}
	}
	return ids
}

// ttNumber says s is a Tenstorrent device number as the driver names one.
func ttNumber(s string) bool { return ttNode.MatchString("tenstorrent!" + s) }
