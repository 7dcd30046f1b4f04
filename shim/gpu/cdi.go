package gpu

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"

	"gopkg.in/yaml.v3"

	"github.com/tandem-run/tandem/api"
)

// cdiKind is the CDI kind of NVIDIA GPUs.
const cdiKind = "nvidia.com/gpu"

// CDIGenerate is the command that writes the host's NVIDIA CDI spec, for
// the messages that tell an operator to run it.
const CDIGenerate = "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"

// maxCDISpec bounds what is read of one CDI spec file (nvidia-ctk's for
// eight GPUs is tens of KiB).
const maxCDISpec = 8 << 20

// CDIGPUNames reads the CDI spec files (*.yaml, *.yml, *.json, as Docker
// and the toolkit do) in dirs and returns the names of the NVIDIA GPU
// devices they define, in order: what a CDI device request
// nvidia.com/gpu=<name> can resolve to. A directory that does not exist
// defines nothing; a spec that cannot be read or parsed is reported in
// problems and skipped, as Docker skips it.
func CDIGPUNames(dirs []string) (names []string, problems []error) {
	for _, dir := range dirs {
		entries, err := os.ReadDir(dir)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		} else if err != nil {
			problems = append(problems, fmt.Errorf("CDI spec dir: %w", err))
			continue
		}
		for _, ent := range entries {
			ext := filepath.Ext(ent.Name())
			if ent.IsDir() || (ext != ".yaml" && ext != ".yml" && ext != ".json") {
				continue
			}
			got, err := cdiGPUsIn(filepath.Join(dir, ent.Name()))
			if err != nil {
				problems = append(problems, err)
				continue
			}
			for _, n := range got {
				if !slices.Contains(names, n) {
					names = append(names, n)
				}
			}
		}
	}
	return names, problems
}

// cdiGPUsIn is the NVIDIA GPU device names of one spec file (YAML, of which
// JSON is a part).
func cdiGPUsIn(path string) ([]string, error) {
	// Only a regular file (a link to one too): a FIFO would block the read,
	// and with it the shim's start.
	if fi, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("CDI spec: %w", err)
	} else if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("CDI spec %s: not a regular file (%s)", path, fi.Mode().Type())
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("CDI spec: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxCDISpec+1))
	if err != nil {
		return nil, fmt.Errorf("CDI spec %s: %w", path, err)
	}
	if len(b) > maxCDISpec {
		return nil, fmt.Errorf("CDI spec %s: larger than %d MiB", path, maxCDISpec>>20)
	}
	var spec struct {
		Kind    string `yaml:"kind"`
		Devices []struct {
			Name string `yaml:"name"`
		} `yaml:"devices"`
	}
	if err := yaml.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("CDI spec %s: %w", path, err)
	}
	if spec.Kind != cdiKind {
		return nil, nil
	}
	var names []string
	for _, d := range spec.Devices {
		if d.Name != "" {
			names = append(names, d.Name)
		}
	}
	return names, nil
}

// CDIMissing returns the ids (NVIDIA UUIDs) of gpus that no name in names
// resolves: a CDI device request for them fails at container start.
func CDIMissing(gpus []GPU, names []string) []string {
	var missing []string
	for _, g := range gpus {
		if g.Vendor != api.GPUVendorNVIDIA {
			continue
		}
		if !slices.Contains(names, g.ID) {
			missing = append(missing, g.ID)
		}
	}
	return missing
}
