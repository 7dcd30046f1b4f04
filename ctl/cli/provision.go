package cli

import (
	"encoding/json"
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/cloudinit"
	"github.com/tandem-run/tandem/ctl"
)

func cloudinitCmd() *cli.Command {
	return &cli.Command{
		Name:  "cloudinit",
		Usage: "render VM user-data (#cloud-config) or a startup script that installs and supervises dstack-shim",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "script", Usage: "render a bash startup script instead of cloud-config"},
			&cli.StringFlag{Name: "shim-url", Usage: "download URL of dstack-shim (a release build: starts on glibc 2.31 or newer)"},
			&cli.StringFlag{Name: "runner-url", Usage: "download URL of the static dstack-runner"},
			&cli.StringFlag{Name: "shim-sha256", Usage: "expected SHA-256 of dstack-shim"},
			&cli.StringFlag{Name: "runner-sha256", Usage: "expected SHA-256 of dstack-runner"},
			&cli.BoolFlag{Name: "baked", Usage: "the image has the binaries (Packer); URLs only fill gaps"},
			&cli.BoolFlag{Name: "install-docker", Usage: "install docker.io with apt when the image has no Docker (otherwise the instance reports unhealthy)"},
			&cli.BoolFlag{Name: "keep-docker-data-root", Usage: "leave Docker's data root where it is (by default it moves to an instance-store NVMe when the host has one, before Docker starts, never formatting a disk that holds data)"},
			&cli.StringFlag{Name: "shim-home", Value: "/root/.dstack", Usage: "DSTACK_SHIM_HOME"},
			&cli.StringFlag{Name: "log-level", Value: "5", Usage: "shim and runner log level"},
			&cli.BoolFlag{Name: "privileged", Usage: "run every container privileged"},
			&cli.StringFlag{Name: "pjrt-device", Usage: "PJRT_DEVICE for containers (TPU)"},
			&cli.BoolFlag{Name: "firewall", Usage: "deny incoming except SSH and --allow-cidr (private ranges by default)"},
			&cli.StringSliceFlag{Name: "allow-cidr", Usage: "CIDR allowed in with --firewall (repeatable)"},
			wholeFlags("public key for the provisioning user (repeatable)", "authorized-key")[0],
			wholeFlags("extra KEY=VALUE for the shim (repeatable)", "env")[0],
		},
		Action: func(c *cli.Context) error {
			v := cloudinit.VM{ShimURL: c.String("shim-url"), RunnerURL: c.String("runner-url"), ShimSHA256: c.String("shim-sha256"),
				RunnerSHA256: c.String("runner-sha256"), Baked: c.Bool("baked"), ShimHome: c.String("shim-home"), LogLevel: c.String("log-level"),
				Privileged: c.Bool("privileged"), PJRTDevice: c.String("pjrt-device"), Firewall: c.Bool("firewall"),
				AllowCIDRs: c.StringSlice("allow-cidr"), AuthorizedKeys: wholeValues(c, "authorized-key"), Env: map[string]string{},
				InstallDocker: c.Bool("install-docker"), KeepDockerDataRoot: c.Bool("keep-docker-data-root")}
			if err := parseEnv(wholeValues(c, "env"), v.Env, nil); err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			render := v.UserData
			if c.Bool("script") {
				render = v.Script
			}
			out, err := render()
			if err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			_, err = fmt.Fprint(c.App.Writer, out)
			return err
		},
	}
}

func entrypointCmd() *cli.Command {
	return &cli.Command{
		Name:  "entrypoint",
		Usage: "render a container entrypoint that starts dstack-runner in any image (container-only clouds)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "runner-url", Usage: "download URL of the static dstack-runner"},
			&cli.StringFlag{Name: "runner-sha256", Usage: "expected SHA-256 of dstack-runner"},
			wholeFlags("public key allowed in over SSH (repeatable)", "authorized-key")[0],
			&cli.IntFlag{Name: "http-port", Value: api.RunnerHTTPPort},
			&cli.IntFlag{Name: "ssh-port", Value: api.RunnerSSHPort},
			&cli.StringFlag{Name: "log-level", Value: "4"},
			&cli.BoolFlag{Name: "json", Usage: `print ["/bin/sh","-c",script] for container APIs`},
		},
		Action: func(c *cli.Context) error {
			e := cloudinit.Entrypoint{RunnerURL: c.String("runner-url"), RunnerSHA256: c.String("runner-sha256"),
				AuthorizedKeys: wholeValues(c, "authorized-key"), HTTPPort: c.Int("http-port"), SSHPort: c.Int("ssh-port"), LogLevel: c.String("log-level")}
			if c.Bool("json") {
				argv, err := e.Command()
				if err != nil {
					return exitError{ctl.ExitFailure, errText(err)}
				}
				enc := json.NewEncoder(c.App.Writer)
				enc.SetEscapeHTML(false)
				return enc.Encode(argv)
			}
			s, err := e.Render()
			if err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			_, err = fmt.Fprint(c.App.Writer, s)
			return err
		},
	}
}
