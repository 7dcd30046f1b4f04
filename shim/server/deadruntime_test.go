package server

import (
	"context"
	"errors"
	"io"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/task"
)

// deadRuntime answers like a Docker daemon that is down.
type deadRuntime struct{}

var errDown = errors.New("cannot connect to the Docker daemon")

func (deadRuntime) ImagePresent(context.Context, string) (bool, error) { return false, errDown }
func (deadRuntime) Pull(context.Context, string, task.RegistryAuth) (io.ReadCloser, error) {
	return nil, errDown
}
func (deadRuntime) Create(context.Context, task.ContainerSpec) (string, error) { return "", errDown }
func (deadRuntime) Start(context.Context, string) error                        { return errDown }
func (deadRuntime) Address(context.Context, string, string) (string, error)    { return "", errDown }
func (deadRuntime) Wait(context.Context, string) (int, error)                  { return -1, errDown }
func (deadRuntime) Stop(context.Context, string, time.Duration) error          { return errDown }
func (deadRuntime) Remove(context.Context, string) error                       { return errDown }
func (deadRuntime) LogTail(context.Context, string, int) (string, error)       { return "", errDown }

func (deadRuntime) Containers(context.Context) ([]task.ContainerState, error) { return nil, errDown }
func (deadRuntime) GPUMode(context.Context) (string, error)                   { return "", errDown }
func (deadRuntime) ImageConfig(context.Context, string) (api.TaskImageConfig, error) {
	return api.TaskImageConfig{}, errDown
}
func (deadRuntime) Inspect(context.Context, string) (task.ContainerState, error) {
	return task.ContainerState{}, errDown
}
