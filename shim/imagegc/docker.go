package imagegc

import (
	"context"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"
)

// DockerAPI is the part of Docker's client the engine adapter calls.
type DockerAPI interface {
	ImageList(ctx context.Context, options image.ListOptions) ([]image.Summary, error)
	ContainerList(ctx context.Context, options container.ListOptions) ([]container.Summary, error)
	ImageRemove(ctx context.Context, imageID string, options image.RemoveOptions) ([]image.DeleteResponse, error)
}

var _ DockerAPI = (*client.Client)(nil)

// Docker is the Engine of a Docker daemon.
type Docker struct{ API DockerAPI }

// Images implements Engine.
func (d Docker) Images(ctx context.Context) ([]Image, error) {
	list, err := d.API.ImageList(ctx, image.ListOptions{All: false})
	if err != nil {
		return nil, err
	}
	out := make([]Image, 0, len(list))
	for _, s := range list {
		var tags []string
		for _, t := range s.RepoTags {
			if t != "<none>:<none>" {
				tags = append(tags, t)
			}
		}
		out = append(out, Image{ID: s.ID, RepoTags: tags, Size: s.Size, Pulled: len(s.RepoDigests) > 0})
	}
	return out, nil
}

// ContainerImageIDs implements Engine.
func (d Docker) ContainerImageIDs(ctx context.Context) ([]string, error) {
	list, err := d.API.ContainerList(ctx, container.ListOptions{All: true})
	if err != nil {
		return nil, err
	}
	ids := make([]string, 0, len(list))
	for _, c := range list {
		ids = append(ids, c.ImageID)
	}
	return ids, nil
}

// RemoveImage implements Engine, unforced: each of its tags in turn (the
// last one removes it: by ID, Docker refuses an image of several tags
// unless forced, and force would take one a stopped container uses), or
// by ID when it has none; its untagged parents go with it.
func (d Docker) RemoveImage(ctx context.Context, img Image) error {
	refs := img.RepoTags
	if len(refs) == 0 {
		refs = []string{img.ID}
	}
	for _, r := range refs {
		if _, err := d.API.ImageRemove(ctx, r, image.RemoveOptions{Force: false, PruneChildren: true}); err != nil {
			return err
		}
	}
	return nil
}
