#include <immintrin.h>
#include <string.h>
struct cfg { unsigned char palette, start; unsigned char r[14]; unsigned short colsb[16]; unsigned char rows[16]; };
int run_tile(void) {
  struct cfg c; memset(&c, 0, sizeof c); c.palette = 1; c.rows[0] = 16; c.colsb[0] = 64;
  static char buf[1024];
  _tile_loadconfig(&c); _tile_zero(0); _tile_stored(0, buf, 64); _tile_release();
  return 1;
}
