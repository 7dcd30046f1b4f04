// Package cli defines dstack-shim's command line: dstack's flags and
// environment variables, so ours drops in.
package cli

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/shim/agent"
	"github.com/tandem-run/tandem/shim/fastpull"
	"github.com/tandem-run/tandem/shim/imagegc"
	"github.com/tandem-run/tandem/shim/netiso"
	"github.com/tandem-run/tandem/shim/task"
)

// versionVerbose prints the reported version, Tandem's release and the
// toolchain; --version stays the three words the server's parser reads.
const versionVerbose = "version-verbose"

// App returns the dstack-shim command. `--version` prints exactly
// "dstack-shim version <v>".
func App() *cli.App {
	return &cli.App{
		Name:    "dstack-shim",
		Usage:   "host agent that runs dstack tasks as Docker containers",
		Version: version.String(),
		Flags:   append(Flags(), &cli.BoolFlag{Name: versionVerbose, Usage: "print the version, Tandem's release and the Go toolchain"}),
		Before: func(c *cli.Context) error {
			if c.Bool(versionVerbose) {
				fmt.Fprint(c.App.Writer, version.Verbose(c.App.Name))
				return cli.Exit("", 0)
			}
			for _, f := range []string{"shim-log-level", "runner-log-level"} {
				if _, err := logging.ParseLevel(c.String(f)); err != nil {
					return err
				}
			}
			return nil
		},
		Action: func(c *cli.Context) error {
			cfg, err := config(c)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return agent.Run(ctx, cfg)
		},
	}
}

func config(c *cli.Context) (agent.Config, error) {
	format, err := logging.ParseFormat(c.String("log-format"))
	if err != nil {
		return agent.Config{}, err
	}
	level, err := logging.ParseLevel(c.String("shim-log-level"))
	if err != nil {
		return agent.Config{}, err
	}
	home := c.String("shim-home")
	if home == "" {
		h, err := os.UserHomeDir()
		if err != nil {
			return agent.Config{}, fmt.Errorf("resolve shim home: %w", err)
		}
		home = filepath.Join(h, ".dstack")
	}
	// The runner is bind-mounted into every task's container, which takes
	// only an absolute source: a relative path (bin/dstack-runner of a
	// build) is this directory's.
	runner, err := filepath.Abs(c.String("runner-binary-path"))
	if err != nil {
		return agent.Config{}, fmt.Errorf("--runner-binary-path: %w", err)
	}
	bin := c.String("shim-binary-path")
	if bin == "" {
		if exe, err := os.Executable(); err == nil {
			bin = exe
		} else {
			bin = "/usr/local/bin/dstack-shim"
		}
	}
	if c.Duration("pull-stall-timeout") <= 0 {
		return agent.Config{}, fmt.Errorf("--pull-stall-timeout must be positive")
	}
	var gcPolicy *imagegc.Policy
	if c.Bool("image-gc") {
		p := imagegc.DefaultPolicy()
		p.HighPercent, p.LowPercent, p.Keep = c.Int("image-gc-high-threshold"), c.Int("image-gc-low-threshold"), c.StringSlice("image-gc-keep")
		p.MinAge = c.Duration("image-gc-min-age")
		if err := p.Validate(); err != nil {
			return agent.Config{}, fmt.Errorf("--image-gc-*: %w", err)
		}
		if c.Duration("image-gc-interval") <= 0 {
			return agent.Config{}, fmt.Errorf("--image-gc-interval must be positive")
		}
		gcPolicy = &p
	}
	if n := c.Int("shim-nice"); n < -20 || n > 19 {
		return agent.Config{}, fmt.Errorf("--shim-nice %d: a nice value is -20 to 19", n)
	}
	return agent.Config{
		Home:              home,
		BinaryPath:        bin,
		HTTPAddress:       c.String("shim-http-address"),
		HTTPPort:          c.Int("shim-http-port"),
		LogLevel:          level,
		LogFormat:         format,
		RunnerDownloadURL: c.String("runner-download-url"),
		ServiceMode:       c.Bool("service"),
		Task: task.Config{
			RunnerBinary:      runner,
			RunnerHTTPPort:    c.Int("runner-http-port"),
			RunnerSSHPort:     c.Int("runner-ssh-port"),
			RunnerLogLevel:    c.String("runner-log-level"),
			RunnerSSHLogLevel: c.String("runner-ssh-log-level"),
			RunnerArgs:        runnerLogArgs(c),
			Env:               containerEnv(strings.Split(c.String("pass-env"), ","), c.String("pjrt-device")),
			Privileged:        c.Bool("privileged"),
			PullStallTimeout:  c.Duration("pull-stall-timeout"),
			PullTimeout:       c.Duration("pull-timeout"),
			VolumesRoot:       c.String("volumes-root"),
			SpillDir:          c.String("state-spill-dir"),
			AdoptUnlabelled:   c.Bool("adopt-unlabeled"),
		},
		DCGMExporterPort:     c.Int("dcgm-exporter-http-port"),
		GPUMetricsInterval:   time.Duration(c.Int("dcgm-exporter-interval")) * time.Millisecond,
		GCPDiskByID:          c.String("gcp-disk-by-id"),
		HostRoot:             c.String("host-root"),
		ReconcileInterval:    c.Duration("reconcile-interval"),
		SubmitWait:           c.Duration("submit-wait"),
		APIAllowContainers:   c.Bool("api-allow-containers"),
		KeepStartupMemory:    c.Bool("keep-startup-memory"),
		APIToken:             c.String("api-token"),
		APIAllowedHosts:      c.StringSlice("api-allowed-host"),
		APIAllowUsers:        c.StringSlice("api-allow-user"),
		DockerPublishesPorts: c.Bool("docker-publish-ports"),
		MetricsAddress:       c.String("metrics-address"),
		PidsLimit:            c.Int64("pids-limit"),
		RunnerDirSize:        c.Int64("runner-dir-size"),
		FastPull: fastpull.Config{
			Enabled:   c.Bool("image-fast-pull"),
			Conns:     c.Int("image-fast-pull-conns"),
			ChunkSize: c.Int64("image-fast-pull-chunk-size"),
			Loopback:  c.Bool("image-fast-pull-loopback"),
		},
		Nice:            c.Int("shim-nice"),
		IsolatedNetwork: c.String("task-network"),
		ImageGC:         gcPolicy,
		ImageGCInterval: c.Duration("image-gc-interval"),
	}, nil
}

// containerEnv is what every container gets: the pass-env variables that
// are set here, as NAME=value, and PJRT_DEVICE when given.
func containerEnv(names []string, pjrtDevice string) []string {
	var env []string
	for _, n := range names {
		n = strings.TrimSpace(n)
		if n == "" {
			continue
		}
		if v, ok := os.LookupEnv(n); ok {
			env = append(env, n+"="+v)
		}
	}
	if pjrtDevice != "" {
		env = append(env, "PJRT_DEVICE="+pjrtDevice)
	}
	return env
}

// runnerLogArgs passes the job log bounds to each runner when set
// (non-zero); unset, the runner's own defaults apply, which also keeps
// dstack's own runner working under this shim.
func runnerLogArgs(c *cli.Context) []string {
	var args []string
	for _, f := range []string{"job-log-max-bytes", "job-log-head-bytes", "log-min-free-bytes"} {
		if v := c.Int64(f); v != 0 {
			args = append(args, "--"+f, strconv.FormatInt(v, 10))
		}
	}
	return args
}

// Flags are dstack-shim's flags with their environment variables.
func Flags() []cli.Flag {
	d := agent.Defaults()
	return []cli.Flag{
		&cli.StringFlag{Name: "shim-home", EnvVars: []string{"DSTACK_SHIM_HOME"}, Usage: "home/state directory (default $HOME/.dstack)"},
		&cli.StringFlag{Name: "state-spill-dir", EnvVars: []string{"TANDEM_SHIM_STATE_SPILL_DIR"}, Usage: "where task records wait when the shim home's filesystem refuses them (full), until written home; kept across a shim restart. On another filesystem (default /run/tandem-shim/<hash of the home>, a tmpfs)"},
		&cli.BoolFlag{Name: "adopt-unlabeled", EnvVars: []string{"TANDEM_SHIM_ADOPT_UNLABELED"}, Usage: "take every task container without Tandem's shim-home label as this shim's (the migration from dstack's agents run with another home); by default only those whose runner dir is under this shim's home are, and other agents' containers are left alone"},
		&cli.StringFlag{Name: "shim-binary-path", EnvVars: []string{"DSTACK_SHIM_BINARY_PATH"}, Usage: "file replaced on shim self-update"},
		&cli.DurationFlag{Name: "submit-wait", Value: d.SubmitWait, EnvVars: []string{"TANDEM_SHIM_SUBMIT_WAIT"}, Usage: "how long a submit's answer waits for its task to run (a task that needs a registry pull is answered when the pull begins), so dstack's server starts the job on its first look instead of one 5-10 s later; 0: answer at once, as dstack's shim does"},
		&cli.DurationFlag{Name: "reconcile-interval", Value: d.ReconcileInterval, Hidden: true, Usage: "how often containers are reconciled with tasks"},
		&cli.BoolFlag{Name: "keep-startup-memory", EnvVars: []string{"TANDEM_SHIM_KEEP_STARTUP_MEMORY"}, Usage: "kill switch: keep the executable's start-up pages mapped (by default they are given back once recovered; idle RSS ~10 MB instead of ~20)"},
		&cli.BoolFlag{Name: "api-allow-containers", EnvVars: []string{"TANDEM_SHIM_API_ALLOW_CONTAINERS"}, Usage: "kill switch: serve callers inside containers too (the API is root on this host)"},
		&cli.StringFlag{Name: "api-token", EnvVars: []string{"TANDEM_SHIM_API_TOKEN"}, Usage: "require this bearer token on every API call (a second factor; the dstack server does not send one)"},
		&cli.Int64Flag{Name: "job-log-max-bytes", EnvVars: []string{"TANDEM_SHIM_JOB_LOG_MAX_BYTES"}, Usage: "passed to each runner: disk kept per job log file, the head and the latest output (runner default 32 MiB; -1 keeps all)"},
		&cli.Int64Flag{Name: "job-log-head-bytes", EnvVars: []string{"TANDEM_SHIM_JOB_LOG_HEAD_BYTES"}, Usage: "passed to each runner: of --job-log-max-bytes, the start always kept (runner default 4 MiB)"},
		&cli.Int64Flag{Name: "log-min-free-bytes", EnvVars: []string{"TANDEM_SHIM_LOG_MIN_FREE_BYTES"}, Usage: "passed to each runner: free space in the shim home below which job output is no longer kept (runner default: a tenth of the filesystem, at most 256 MiB; -1: none)"},
		&cli.StringFlag{Name: "task-network", Value: netiso.DefaultName, EnvVars: []string{"TANDEM_SHIM_TASK_NETWORK"}, Usage: "bridge network (created with inter-container traffic off) that bridge-mode tasks join, so tasks cannot reach each other; \"\" for Docker's default bridge"},
		&cli.StringSliceFlag{Name: "api-allow-user", EnvVars: []string{"TANDEM_SHIM_API_ALLOW_USERS"}, Usage: "local accounts admitted to the API and the task ports besides root-equivalent ones (root, accounts the host's sudo lets run a shell as root, the Docker socket's group): a uid, a user name or @group; repeat or comma-separate"},
		&cli.Int64Flag{Name: "runner-dir-size", Value: d.RunnerDirSize, EnvVars: []string{"TANDEM_SHIM_RUNNER_DIR_SIZE"}, Usage: "bytes each task's runner dir may hold (a sparse ext4 image of its own, loop-mounted; the job gets ENOSPC there, the shim home keeps its room): less, down to 16 MiB, where the home's disk has less than twice that left above its floor, and a submit is refused with 507 below that; 0: plain, unbounded directories"},
		&cli.IntFlag{Name: "shim-nice", Value: d.Nice, EnvVars: []string{"TANDEM_SHIM_NICE"}, Usage: "CPU priority (nice, -20 to 19) the shim gives itself when started at the default 0, so its API answers while jobs and Docker keep every CPU busy; one it was started with (nice, systemd's Nice=) stands; 0: leave it"},
		&cli.Int64Flag{Name: "pids-limit", EnvVars: []string{"TANDEM_SHIM_PIDS_LIMIT"}, Usage: "each task's processes and threads at most (0: an eighth of the kernel's pid_max, between 2048 and 32768; -1: no limit); a tandem run may ask for its own"},
		&cli.StringFlag{Name: "metrics-address", EnvVars: []string{"TANDEM_SHIM_METRICS_ADDRESS"}, Usage: "also serve GET /metrics alone on this address (host:port; off by default), for a scraper the API refuses (in a container, on another machine, its own account); nothing else answers there"},
		&cli.BoolFlag{Name: "docker-publish-ports", EnvVars: []string{"TANDEM_SHIM_DOCKER_PUBLISH_PORTS"}, Usage: "kill switch: let Docker publish bridge tasks' runner ports (every local account reaches them) instead of the shim's forwards, which admit only the API's callers"},
		&cli.StringSliceFlag{Name: "api-allowed-host", EnvVars: []string{"TANDEM_SHIM_API_ALLOWED_HOSTS"}, Usage: "Host header names accepted besides loopback ones (* for any)"},
		&cli.IntFlag{Name: "shim-http-port", Value: api.ShimHTTPPort, EnvVars: []string{"DSTACK_SHIM_HTTP_PORT"}, Usage: "API port"},
		&cli.StringFlag{Name: "shim-http-address", Value: "127.0.0.1", EnvVars: []string{"DSTACK_SHIM_HTTP_ADDRESS"}, Usage: "API bind address"},
		&cli.StringFlag{Name: "log-format", Value: "text", EnvVars: []string{"TANDEM_LOG_FORMAT"}, Usage: "text or json (one object per line)"},
		&cli.StringFlag{Name: "shim-log-level", Value: "info", EnvVars: []string{"DSTACK_SHIM_LOG_LEVEL"}, Usage: "fatal, error, warn, info, debug, trace or 1..6"},
		&cli.StringFlag{Name: "runner-download-url", EnvVars: []string{"DSTACK_RUNNER_DOWNLOAD_URL"}, Usage: "download the runner from here at start when missing"},
		&cli.StringFlag{Name: "runner-binary-path", Value: task.Defaults().RunnerBinary, EnvVars: []string{"DSTACK_RUNNER_BINARY_PATH"}, Usage: "host path of the runner binary"},
		&cli.IntFlag{Name: "runner-http-port", Value: task.Defaults().RunnerHTTPPort, EnvVars: []string{"DSTACK_RUNNER_HTTP_PORT"}, Usage: "runner HTTP port"},
		&cli.IntFlag{Name: "runner-ssh-port", Value: task.Defaults().RunnerSSHPort, EnvVars: []string{"DSTACK_RUNNER_SSH_PORT"}, Usage: "runner SSH port"},
		&cli.StringFlag{Name: "runner-ssh-log-level", EnvVars: []string{"DSTACK_RUNNER_SSH_LOG_LEVEL"}, Usage: "runner SSH log level"},
		&cli.StringFlag{Name: "runner-log-level", Value: task.Defaults().RunnerLogLevel, EnvVars: []string{"DSTACK_RUNNER_LOG_LEVEL"}, Usage: "runner log level"},
		&cli.IntFlag{Name: "dcgm-exporter-http-port", Value: api.DCGMExporterHTTPPort, EnvVars: []string{"DSTACK_DCGM_EXPORTER_HTTP_PORT"}, Usage: "dcgm-exporter port"},
		&cli.IntFlag{Name: "dcgm-exporter-interval", Value: int(d.GPUMetricsInterval / time.Millisecond), EnvVars: []string{"DSTACK_DCGM_EXPORTER_INTERVAL"}, Usage: "how often GPU metrics are sampled (from NVML, or fetched from dcgm-exporter), ms"},
		// Accepted and ignored: dstack's shim reaches nv-hostengine here for
		// DCGM health checks; ours reads health from NVML (XID events), so
		// command lines and environments written for dstack keep working.
		&cli.StringFlag{Name: "dcgm-address", EnvVars: []string{"DSTACK_DCGM_ADDRESS"}, Usage: "accepted for dstack compatibility and ignored: GPU health comes from NVML"},
		&cli.StringFlag{Name: "pass-env", Value: "http_proxy,https_proxy,no_proxy,HTTP_PROXY,HTTPS_PROXY,NO_PROXY", EnvVars: []string{"DSTACK_DOCKER_PASS_ENV"}, Usage: "comma list of env vars copied into containers"},
		&cli.BoolFlag{Name: "privileged", EnvVars: []string{"DSTACK_DOCKER_PRIVILEGED"}, Usage: "run all containers privileged"},
		&cli.StringFlag{Name: "pjrt-device", EnvVars: []string{"PJRT_DEVICE"}, Usage: "set PJRT_DEVICE in containers"},
		&cli.BoolFlag{Name: "service", EnvVars: []string{"DSTACK_SERVICE_MODE"}, Usage: "write host_info.json on start"},
		&cli.StringFlag{Name: "volumes-root", Value: task.Defaults().VolumesRoot, EnvVars: []string{"DSTACK_SHIM_VOLUMES_ROOT"}, Usage: "where network volumes are mounted"},
		&cli.StringFlag{Name: "host-root", Value: d.HostRoot, Hidden: true, EnvVars: []string{"TANDEM_SHIM_HOST_ROOT"}, Usage: "where the host's files are read (AMD GPUs' sysfs, accounts): a fixture tree in tests"},
		&cli.StringFlag{Name: "gcp-disk-by-id", Value: d.GCPDiskByID, Hidden: true, Usage: "GCP disk links (tests point it at fixtures)"},
		&cli.DurationFlag{Name: "pull-stall-timeout", Value: task.Defaults().PullStallTimeout, EnvVars: []string{"DSTACK_SHIM_PULL_STALL_TIMEOUT"}, Usage: "fail an image pull when no byte moved for this long"},
		&cli.BoolFlag{Name: "image-fast-pull", Value: fastpull.Defaults().Enabled, EnvVars: []string{"TANDEM_SHIM_FAST_PULL"}, Usage: "pull images over ranged parallel connections and serve their blobs, as they arrive, to Docker's own pull from a registry on loopback (Docker's pull from the registry when that cannot be done as Docker would)"},
		&cli.IntFlag{Name: "image-fast-pull-conns", Value: fastpull.Defaults().Conns, EnvVars: []string{"TANDEM_SHIM_FAST_PULL_CONNS"}, Usage: "connections one fast image pull opens at most"},
		&cli.Int64Flag{Name: "image-fast-pull-chunk-size", Value: fastpull.Defaults().ChunkSize, Hidden: true, EnvVars: []string{"TANDEM_SHIM_FAST_PULL_CHUNK_SIZE"}, Usage: "bytes one ranged request of a fast pull asks for (tests make it small)"},
		// Accepted, and ignored, only so that configs written for the
		// ImageLoad hand-off (which it switched) still start the shim.
		&cli.BoolFlag{Name: "image-fast-pull-inflate", EnvVars: []string{"TANDEM_SHIM_FAST_PULL_INFLATE"}, Usage: "deprecated, does nothing: Docker's own pull inflates the layers the fast pull serves it"},
		&cli.BoolFlag{Name: "image-fast-pull-loopback", Hidden: true, EnvVars: []string{"TANDEM_SHIM_FAST_PULL_LOOPBACK"}, Usage: "take the fast pull for registries on this machine too (tests; Docker's pull is faster there)"},
		&cli.DurationFlag{Name: "pull-timeout", Value: task.Defaults().PullTimeout, EnvVars: []string{"DSTACK_SHIM_PULL_TIMEOUT"}, Usage: "overall cap on one image pull (0: none)"},
		&cli.BoolFlag{Name: "image-gc", Value: true, EnvVars: []string{"TANDEM_SHIM_IMAGE_GC"}, Usage: "remove unused images, least recently used first, when Docker's disk fills past --image-gc-high-threshold (--image-gc=false: never)"},
		&cli.IntFlag{Name: "image-gc-high-threshold", Value: imagegc.DefaultPolicy().HighPercent, EnvVars: []string{"TANDEM_SHIM_IMAGE_GC_HIGH_THRESHOLD"}, Usage: "image GC starts when Docker's data root filesystem is this full, percent"},
		&cli.IntFlag{Name: "image-gc-low-threshold", Value: imagegc.DefaultPolicy().LowPercent, EnvVars: []string{"TANDEM_SHIM_IMAGE_GC_LOW_THRESHOLD"}, Usage: "image GC frees down to this, percent"},
		&cli.StringSliceFlag{Name: "image-gc-keep", EnvVars: []string{"TANDEM_SHIM_IMAGE_GC_KEEP"}, Usage: "images image GC never removes (references or IDs; pre-pulled ones), repeatable or comma-separated"},
		&cli.DurationFlag{Name: "image-gc-interval", Value: time.Minute, Hidden: true, EnvVars: []string{"TANDEM_SHIM_IMAGE_GC_INTERVAL"}, Usage: "how often image GC looks at the disk"},
		&cli.DurationFlag{Name: "image-gc-min-age", Value: imagegc.DefaultPolicy().MinAge, Hidden: true, EnvVars: []string{"TANDEM_SHIM_IMAGE_GC_MIN_AGE"}, Usage: "image GC leaves an image first seen less than this ago"},
	}
}
