package task

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/tandem-run/tandem/api"
)

// ImageConfig returns the config of the image the task's container was
// made from (Tandem's own route: a client runs the image's own command
// with it). The container's image is asked, by its id, not the task's
// image name: a tag pulled again since points elsewhere. ErrNotFound for
// no such task; ErrConflict while the task has no container (its image is
// not here yet, or it failed before one was made) and once it is gone.
func (e *Engine) ImageConfig(ctx context.Context, id string) (api.TaskImageConfig, error) {
	t, ok := e.lookup(id)
	if !ok {
		return api.TaskImageConfig{}, ErrNotFound
	}
	t.mu.Lock()
	contID, status := t.held.Container.ID, t.status
	t.mu.Unlock()
	if contID == "" {
		return api.TaskImageConfig{}, fmt.Errorf("%w: task %s has no container yet (%s): its image config is known once the image is pulled and the container made", ErrConflict, id, status)
	}
	cfg, err := e.rt.ImageConfig(ctx, contID)
	switch {
	case errors.Is(err, ErrContainerGone):
		return api.TaskImageConfig{}, fmt.Errorf("%w: task %s's container is gone (%s)", ErrConflict, id, status)
	case err != nil:
		e.log.Error("image config", "task_id", id, "container_id", contID, "err", err)
		return api.TaskImageConfig{}, fmt.Errorf("task %s: image config: %w", id, err)
	}
	// The image is anyone's: its config is bounded by what a job's submit
	// may carry (a client makes one of it), so no answer is larger.
	if b, err := json.Marshal(cfg); err != nil || len(b) > api.MaxJSONBody {
		e.log.Warn("image config too large", "task_id", id, "bytes", len(b))
		return api.TaskImageConfig{}, fmt.Errorf("%w: task %s's image config is %d bytes, more than the %d a job's submit takes", ErrConflict, id, len(b), api.MaxJSONBody)
	}
	return cfg, nil
}
