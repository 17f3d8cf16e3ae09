/* Builds against an installed zeroshard, through find_package or pkg-config,
 * and runs a world of one end to end. */
#include <stdio.h>
#include <zeroshard/zeroshard.h>

int main(void) {
  zs_context ctx;
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  if (zs_context_create(&ctx, &o) != ZS_OK) {
    fprintf(stderr, "zs_context_create: %s\n", zs_last_error());
    return 1;
  }
  printf("zeroshard %s (header %d)\n", zs_version(NULL, NULL, NULL), ZS_VERSION);
  return zs_context_destroy(ctx) == ZS_OK ? 0 : 1;
}
