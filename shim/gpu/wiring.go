package gpu

import (
	"slices"
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

// Wiring is what a container needs to see its GPUs.
type Wiring struct {
	Request     *Request // NVIDIA
	Devices     []string // device nodes mapped at the same path (AMD)
	IpcHost     bool
	CapAdd      []string
	SecurityOpt []string
}

// Wire encodes ids (GPU UUIDs for NVIDIA, render nodes for AMD) for vendor.
// cdi picks CDI device requests over the runtime hook for NVIDIA.
func Wire(vendor api.GPUVendor, ids []string, cdi bool) Wiring {
	switch vendor {
	case api.GPUVendorNVIDIA:
		if cdi {
			names := make([]string, 0, len(ids))
			for _, id := range ids {
				names = append(names, cdiPrefix+id)
			}
			return Wiring{Request: &Request{Driver: "cdi", DeviceIDs: names}}
		}
		return Wiring{Request: &Request{DeviceIDs: slices.Clone(ids), Capabilities: slices.Clone(NVIDIACapabilities)}}
	case api.GPUVendorAMD:
		return Wiring{Devices: append([]string{"/dev/kfd"}, ids...), IpcHost: true,
			CapAdd: []string{"SYS_PTRACE"}, SecurityOpt: []string{"seccomp=unconfined"}}
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

// IDsFromContainer decodes a container's GPU ids from its device-request
// ids and its mapped host device paths: the inverse of Wire.
func IDsFromContainer(requestIDs, hostDevices []string) []string {
	var ids []string
	for _, id := range requestIDs {
		ids = append(ids, strings.TrimPrefix(id, cdiPrefix))
	}
	for _, d := range hostDevices {
		if strings.HasPrefix(d, amdRender) {
			ids = append(ids, d)
		}
	}
	return ids
}
